"""Tools, prompt, tool-call parsing, the agent loop and token-exact trajectories.

Must not import torch: the harness drives any backend through
`atelier.inference.types.TokenModel` or an OpenAI-compatible endpoint.
"""
