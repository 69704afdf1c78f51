"""Load-aware PD router (planned).

Will hold: the OpenAI-compatible asynchronous HTTP front that pairs a prefill
and a decode worker per request by load alone, with the stock policies
(round_robin, power_of_two, cache_aware) beside it. Until then the launcher
puts the stock ``sglang_router`` in front (``bana_sglang.launch``).
"""
