"""HTTP adapters (httpx, uvicorn): the metaserver client Decode posts its contact to,
the watch on the proxy's failed dispatches, and the uvicorn runner the proxy and the
demo serve under. The proxy itself is ``rd2h.proxy``."""
