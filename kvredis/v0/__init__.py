"""The seed's API: the lookup buffer (``insert``/``drop_select``,
:class:`~kvredis.v0.buffer.RedisLookupBuffer`) and the KV connector of vLLM's V0 engine over it
(:class:`~kvredis.v0.connector.RedisConnector`).

Both are importable from :mod:`kvredis` itself. Nothing here imports vLLM or :mod:`kvredis.vllm`.
"""
