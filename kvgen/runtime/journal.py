"""The undo journal of :meth:`BlockManager.reserve_step <.block_manager.BlockManager.reserve_step>`.

While a step is reserved, every mutation of the manager's books appends one
entry saying how to undo it; a step that fails replays the entries backwards
(:func:`rollback`), so the cost of a failure is proportional to the step's
own changes, never to the size of the pools. Entries are tuples whose first
item is one of the operation names below (compared by identity).
"""

from __future__ import annotations

from collections import OrderedDict
from operator import itemgetter
from typing import Any

REF = "ref"                      # (REF, pool, page, old ref count)
FREE_POP = "free_pop"            # (FREE_POP, pool, page): a page taken off a free list
FREE_PUSH = "free_push"          # (FREE_PUSH, pool): a page pushed onto a free list
TABLE_APPEND = "tappend"         # (TABLE_APPEND, seq)
TABLE_SET = "tset"               # (TABLE_SET, seq, index, old page)
SEQ = "seq"                      # (SEQ, seq, length, num_compressed, len(hashes), pending, known)
PARK = "park"                    # (PARK,): a page parked until the step ends
UNPARK = "unpark"                # (UNPARK, parked pages before)
LRU_ADD = "lru_add"              # (LRU_ADD, lru name, page)
LRU_REMOVE = "lru_remove"        # (LRU_REMOVE, lru name, page, stamp, hash or None if it stayed registered)
REGISTER = "register"            # (REGISTER, cache name, page, hash)
SPILL = "spill"                  # (SPILL,): a prefix-cache page copied to the host tier


def rollback(bm: Any, journal: list, stamp: int) -> None:
    """Undo a failed step of ``bm``: replay ``journal`` backwards and restore the LRU stamp counter."""
    resort: set[str] = set()
    pools = bm._pools
    for entry in reversed(journal):
        op = entry[0]
        if op is REF:
            pools[entry[1]].ref[entry[2]] = entry[3]
        elif op is FREE_POP:
            pools[entry[1]].free.append(entry[2])
        elif op is FREE_PUSH:
            pools[entry[1]].free.pop()
        elif op is TABLE_APPEND:
            entry[1].table.pop()
        elif op is TABLE_SET:
            entry[1].table[entry[2]] = entry[3]
        elif op is SEQ:
            s = entry[1]
            s.length, s.num_compressed, s.pending, s.known = entry[2], entry[3], entry[5], entry[6]
            del s.hashes[entry[4]:]
        elif op is PARK:
            bm._parked.pop()
        elif op is UNPARK:
            bm._parked[:] = entry[1]
        elif op is LRU_ADD:
            del bm._caches[entry[1]].lru[entry[2]]
        elif op is LRU_REMOVE:
            cache, page, page_stamp, h = bm._caches[entry[1]], entry[2], entry[3], entry[4]
            cache.lru[page] = page_stamp
            resort.add(entry[1])
            if h is not None:
                cache.hash_page[h] = page
                cache.page_hash[page] = h
        elif op is REGISTER:
            cache = bm._caches[entry[1]]
            del cache.hash_page[entry[3]]
            del cache.page_hash[entry[2]]
        elif op is SPILL:
            bm._spills.pop()
    for name in resort:  # re-inserted pages went to the end: restore release order (rare: a failed step)
        cache = bm._caches[name]
        cache.lru = OrderedDict(sorted(cache.lru.items(), key=itemgetter(1)))
    bm._stamp = stamp
