"""HTTP adapters (httpx, FastAPI, uvicorn): the metaserver client Decode uses and the
``rd2h proxy`` rendezvous proxy a deployment puts in front of the engines."""
