"""The target model: loading (GGUF cache, Hub, presets), our Llama/Qwen2 forward and its KV cache,
weight formats, the memory plan, and measured pass costs.
"""
