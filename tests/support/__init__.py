"""What the tests share, imported as ``tests.support.<module>`` (pyproject.toml's pytest
``pythonpath`` puts the repo root on sys.path; tests/ is a namespace package). A test module
imports from here, never from another test module, and never edits sys.path
(tests/test_layout.py checks both).

Models and checkpoints made in the test:
    hf_models        tiny random HF checkpoints (Llama, Qwen, gpt-oss ...) and their logits, ours and HF's
    lora_adapters    PEFT adapters on a HF model, and HF's greedy decoding with them merged
    eagle_heads      random-weight EAGLE / EAGLE3 heads in the published formats
    vision_models    tiny llava-hf LLaVA (CLIP or SigLIP tower) and Qwen2.5-VL folders
    tiny_runners     the kernel tests' tiny Qwen3, a torch/Triton runner pair, eager graph capture
Driving the engine and its parts:
    smollm_engine    the shared SmolLM2 behind a running engine; a dense forward's logprobs
    spec_streams     speculative decoding's requests, streams without speculation, comparisons
    greedy_runs      chat prompts and greedy decoding through ModelRunner
    tp_ranks         a function run on N tensor-parallel ranks (gloo on loopback)
    fake_nixl        a stand-in for NIXL's transfer agent
    fake_engine      an engine stand-in for the web tests
Stage-level requests and checks:
    rendered         a RenderedRequest for stage tests
    render_requests  requests rendered over a fake tokenizer
    harmony_turns    Harmony (gpt-oss) turns, their tokens, and those tokens parsed
    scheduler_workload  the scheduler tests' randomised workload and runner model
    scheduler_checks    the scheduler's and block manager's invariants
Servers and processes:
    live_servers     a real server in this trio run, in a thread, or as `tailrace serve`; its figures
    serve_processes  `tailrace serve --api-server-count N` processes, and what /proc says of them
    vision_chats     pictures and the chats that carry them, and transformers' answer
    sse_server       a scripted SSE responder on loopback (bench tests)
    openai_chunks    SSE events as OpenAI-compatible servers stream them
Checks:
    blocked_imports  import modules with torch, triton and xgrammar blocked
    device_check     host tensors that meet device tensors, found without a GPU
"""
