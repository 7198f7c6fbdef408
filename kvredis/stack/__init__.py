"""Running kvredis: ``kvredis up`` (:mod:`kvredis.stack.up`: Redis, prefill and decode engines and the proxy
as one supervised stack), the proxy (:mod:`kvredis.stack.proxy`), the supervisor and its watchdog, the demo,
and the tiny models the stack serves without a download (:mod:`kvredis.stack.tinymodel`).

The proxy reads announcements (:mod:`kvredis.store.announcement`) and runs without vLLM; only the engines the
stack starts need it.
"""
