"""LLM rephrasing of pre-training text (report section 2.2): style bank, chunk-wise rewriting, fidelity checks,
resumable sharded corpus jobs. Above `llm` in the import order: it drives a `ChatModel`."""
