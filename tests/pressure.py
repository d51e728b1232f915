"""Engine options for tests whose subject is preemption: admission by vLLM's rule (the first prompt
chunk and the watermark only), so a small cache fills with prompts and running requests are
preempted as they grow. The default learned estimate (`engine.page_budget`) admits so that
requests running to max_tokens are not preempted at all."""

PREEMPTING: dict[str, object] = {"kv_growth_estimate": "none"}
