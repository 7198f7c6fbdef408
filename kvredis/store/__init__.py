"""Redis and what kvredis keeps in it: the connection and its errors, the wire framing and value codec, the
key layout, the chunk store and transfers, and the namespace's tally, generation and metrics.

This layer imports nothing of the connectors (:mod:`kvredis.vllm`, :mod:`kvredis.v0`) or of the stack
(:mod:`kvredis.stack`); only :mod:`kvredis.config` and :mod:`kvredis.errors` lie below it.
"""
