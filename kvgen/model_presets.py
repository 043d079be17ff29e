"""Built-in model presets: plain data, turned into ``ModelSpec`` objects by ``kvgen.models``.

Every row copies the published Hugging Face ``config.json`` named in its
comment; ``num_params`` is the published parameter count, which
``kvgen.models.count_params`` reproduces from the row (tests check this
within 1%, which catches a mistyped layer count or width). This module
imports nothing from kvgen so that the table stays pure data.

Where a config key was absent, the transformers default for that model type
is used and the comment says so.
"""

# Column order of every row in PRESETS.
COLUMNS = (
    "name", "architecture", "num_layers", "hidden_size", "num_q_heads", "num_kv_heads",
    "head_dim", "intermediate_size", "vocab_size", "max_positions", "rope_theta",
    "sliding_window", "tied_embeddings", "num_params", "num_experts", "num_experts_per_tok",
)

# fmt: off
PRESETS = (
    # meta-llama/Llama-2-7b-hf (no rope_theta key: transformers default 10000)
    ("llama-2-7b", "LlamaForCausalLM", 32, 4096, 32, 32, 128, 11008, 32000, 4096, 10000.0, None, False, 6_738_415_616, 1, 1),
    # meta-llama/Llama-2-13b-hf (no rope_theta key: transformers default 10000)
    ("llama-2-13b", "LlamaForCausalLM", 40, 5120, 40, 40, 128, 13824, 32000, 4096, 10000.0, None, False, 13_015_864_320, 1, 1),
    # meta-llama/Llama-2-70b-hf (no rope_theta key: transformers default 10000)
    ("llama-2-70b", "LlamaForCausalLM", 80, 8192, 64, 8, 128, 28672, 32000, 4096, 10000.0, None, False, 68_976_648_192, 1, 1),
    # meta-llama/Meta-Llama-3-8B
    ("llama-3-8b", "LlamaForCausalLM", 32, 4096, 32, 8, 128, 14336, 128256, 8192, 500000.0, None, False, 8_030_261_248, 1, 1),
    # meta-llama/Meta-Llama-3-70B
    ("llama-3-70b", "LlamaForCausalLM", 80, 8192, 64, 8, 128, 28672, 128256, 8192, 500000.0, None, False, 70_553_706_496, 1, 1),
    # meta-llama/Llama-3.1-405B (rope_scaling "llama3", factor 8, not modelled here)
    ("llama-3.1-405b", "LlamaForCausalLM", 126, 16384, 128, 8, 128, 53248, 128256, 131072, 500000.0, None, False, 405_853_388_800, 1, 1),
    # meta-llama/Llama-3.2-1B (head_dim 64 given explicitly; embeddings tied)
    ("llama-3.2-1b", "LlamaForCausalLM", 16, 2048, 32, 8, 64, 8192, 128256, 131072, 500000.0, None, True, 1_235_814_400, 1, 1),
    # meta-llama/Llama-3.2-3B (embeddings tied)
    ("llama-3.2-3b", "LlamaForCausalLM", 28, 3072, 24, 8, 128, 8192, 128256, 131072, 500000.0, None, True, 3_212_749_824, 1, 1),
    # mistralai/Mistral-7B-v0.1 (sliding_window 4096 on every layer)
    ("mistral-7b", "MistralForCausalLM", 32, 4096, 32, 8, 128, 14336, 32000, 32768, 10000.0, 4096, False, 7_241_732_096, 1, 1),
    # mistralai/Mixtral-8x7B-v0.1 (sliding_window null; 8 local experts, top-2)
    ("mixtral-8x7b", "MixtralForCausalLM", 32, 4096, 32, 8, 128, 14336, 32000, 32768, 1000000.0, None, False, 46_702_792_704, 8, 2),
    # Qwen/Qwen2.5-0.5B (use_sliding_window false, so no window; q/k/v carry biases)
    ("qwen2.5-0.5b", "Qwen2ForCausalLM", 24, 896, 14, 2, 64, 4864, 151936, 32768, 1000000.0, None, True, 494_032_768, 1, 1),
    # Qwen/Qwen2.5-7B (use_sliding_window false, so no window; q/k/v carry biases)
    ("qwen2.5-7b", "Qwen2ForCausalLM", 28, 3584, 28, 4, 128, 18944, 152064, 131072, 1000000.0, None, False, 7_615_616_512, 1, 1),
    # Qwen/Qwen2.5-72B (use_sliding_window false, so no window; q/k/v carry biases)
    ("qwen2.5-72b", "Qwen2ForCausalLM", 80, 8192, 64, 8, 128, 29568, 152064, 131072, 1000000.0, None, False, 72_706_203_648, 1, 1),
    # google/gemma-2-9b (window 4096 on alternate layers; head_dim 256 != hidden/heads; tied)
    ("gemma-2-9b", "Gemma2ForCausalLM", 42, 3584, 16, 8, 256, 14336, 256000, 8192, 10000.0, 4096, True, 9_241_705_984, 1, 1),
    # microsoft/Phi-3-mini-4k-instruct (sliding_window 2047 as published; fused qkv/gate_up, same count)
    ("phi-3-mini", "Phi3ForCausalLM", 32, 3072, 32, 32, 96, 8192, 32064, 4096, 10000.0, 2047, False, 3_821_079_552, 1, 1),
    # HuggingFaceTB/SmolLM2-135M (embeddings tied)
    ("smollm2-135m", "LlamaForCausalLM", 30, 576, 9, 3, 64, 1536, 49152, 8192, 100000.0, None, True, 134_515_008, 1, 1),
)
# fmt: on

# Other spellings accepted for a preset (lower case). Hub ids are deliberately
# not aliases: a hub id means "that checkpoint's config", which kvgen reads
# from the local cache or refuses, rather than silently substituting a preset.
ALIASES = {
    "llama-3-8b-instruct": "llama-3-8b",
    "llama-3-70b-instruct": "llama-3-70b",
    "mistral-7b-v0.1": "mistral-7b",
    "mixtral-8x7b-v0.1": "mixtral-8x7b",
    "phi-3-mini-4k": "phi-3-mini",
    "phi-3-mini-4k-instruct": "phi-3-mini",
}
