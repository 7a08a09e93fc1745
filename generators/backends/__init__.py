"""Generator backends behind one interface (base.py). Each is built by its config's ``build()``
(generators/config.py, chosen by ``backend.type``), which imports the backend's module only then.

    torch.py      transformers with a KV cache, in this process (the CPU default)
    vllm.py       a vLLM engine in this process
    sglang.py     a separately started SGLang server, over HTTP
    simulated.py  no model: valid completions at a set speed (benchmarks)
"""
