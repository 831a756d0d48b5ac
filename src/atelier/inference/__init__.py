"""Model loading, the local batched engine, the OpenAI-compatible server and clients."""
