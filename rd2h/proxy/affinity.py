"""Prefix affinity for ``rd2h proxy``'s Decode picking: a request whose prompt begins
like one Decode served recently goes back to that Decode, whose prefix cache then
holds most of the prompt, so only the rest is pulled from Prefill.

The proxy does not tokenize. A prompt is reduced to a canonical text (a completion's
string, its token ids joined, or a chat's messages role by role), cut into chunks of
``chunk_chars`` characters, and each whole-chunk prefix is named by a chained hash
(the hash of chunk *k* covers chunks 1..k). The table maps prefix hashes to the
Decode instance that last served a prompt with that prefix; a lookup takes the
longest prefix the table knows. Bounded: at most ``max_entries`` hashes (least
recently used go first) and ``max_chunks`` chunks per prompt.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any


def prompt_text(body: Mapping[str, Any]) -> str | None:
    """The canonical text of a request's prompt; None when there is none to key on
    (a prompt list: its prompts may go to different places; prompt embeddings)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = []
        for m in messages:
            if not isinstance(m, Mapping):
                return None
            content = m.get("content")
            text = content if isinstance(content, str) else json.dumps(content, sort_keys=True)
            parts.append(f"{m.get('role')}\x1f{text}\x1e")
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return "".join(f"{t}," for t in prompt)
    return None


class PrefixAffinity:
    def __init__(self, *, chunk_chars: int = 64, max_chunks: int = 256,
                 max_entries: int = 100_000) -> None:
        if chunk_chars < 1 or max_chunks < 1 or max_entries < 1:
            raise ValueError("chunk_chars, max_chunks and max_entries must be >= 1")
        self.chunk_chars = chunk_chars
        self.max_chunks = max_chunks
        self.max_entries = max_entries
        self._table: OrderedDict[bytes, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._table)

    def _prefixes(self, text: str) -> list[bytes]:
        out: list[bytes] = []
        h = b""
        n = min(len(text) // self.chunk_chars, self.max_chunks)
        for k in range(n):
            chunk = text[k * self.chunk_chars:(k + 1) * self.chunk_chars]
            h = hashlib.blake2b(h + chunk.encode("utf-8", "surrogatepass"),
                                digest_size=16).digest()
            out.append(h)
        return out

    def lookup(self, text: str) -> tuple[str, int] | None:
        """``(instance, matched characters)`` for the longest known prefix, or None."""
        prefixes = self._prefixes(text)
        for k in range(len(prefixes) - 1, -1, -1):
            url = self._table.get(prefixes[k])
            if url is not None:
                self._table.move_to_end(prefixes[k])
                return url, (k + 1) * self.chunk_chars
        return None

    def record(self, text: str, url: str) -> None:
        """``url`` now holds this prompt's prefixes."""
        for h in self._prefixes(text):
            self._table[h] = url
            self._table.move_to_end(h)
        while len(self._table) > self.max_entries:
            self._table.popitem(last=False)

    def forget(self, url: str) -> int:
        """Drop every prefix pointing at ``url`` (it was removed); how many."""
        gone = [h for h, u in self._table.items() if u == url]
        for h in gone:
            del self._table[h]
        return len(gone)
