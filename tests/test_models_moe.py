"""Chapter 10's model oracles: tiny random Hugging Face checkpoints of Mixtral, Qwen3-MoE,
DeepSeek-V2 and DeepSeek-V3 (save_pretrained, loaded through the HF-folder path) give transformers'
logits and greedy tokens in fp32 on a CPU, through the packed forward (no cache: MLA's naive path)
and through LLM / the engine (paged latent cache: the absorbed path); the engine oracle (batched =
alone, with chunking, prefix hits and preemption) holds for a MoE and an MLA model; checkpoints with
a missing or an extra expert tensor, and configs with top-k > experts, are errors naming it.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from test_engine import alone, blocks_for, pad_steps_eagerly, random_requests, replayed_both_kinds
from test_model_parity import GREEDY, GREEDY_STEPS, _hf_greedy, _hf_logits, _packed_logits
from tiny_models import MOE_FAMILIES, VOCAB, hf_model, make_tiny

from minillm import LLM
from minillm.config import MLAConfig, ModelConfig, MoEConfig
from minillm.engine import EngineConfig, LLMEngine
from minillm.loader import load_model

ATOL_FP32 = 1e-3  # on logits of magnitude ~5-15; measured differences are 1e-5 to 4e-5


@pytest.fixture(scope="module", params=list(MOE_FAMILIES))
def tiny(request, tmp_path_factory):
    family = request.param
    folder = make_tiny(family, tmp_path_factory.mktemp(family))
    return family, folder, hf_model(folder)


def test_tiny_logits_match_hf(tiny, seed):
    family, folder, hf = tiny
    model, config, _ = load_model(folder)
    assert config.architecture == family and config.moe is not None
    rng = random.Random(seed)
    seqs = [[rng.randrange(VOCAB) for _ in range(n)] for n in (rng.randint(20, 50), 1, rng.randint(2, 19))]
    for ours, ids in zip(_packed_logits(model, seqs), seqs):
        assert (ours - _hf_logits(hf, ids)).abs().max().item() < ATOL_FP32, family


@pytest.mark.slow
def test_tiny_greedy_matches_hf_through_the_engine(tiny, seed):
    family, folder, hf = tiny
    llm = LLM(folder, dtype="float32", device="cpu", block_size=4)  # a prompt over several blocks
    prompt = [random.Random(seed).randrange(VOCAB) for _ in range(12)]
    ours = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert ours == _hf_greedy(hf, prompt, GREEDY_STEPS), family


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the GPU machine)")
def test_tiny_greedy_on_cuda_matches_hf(tiny, seed):
    """The Triton kernels (fused MoE, paged MLA, fp32 IEEE dots) inside CUDA graphs give HF's tokens."""
    family, folder, hf = tiny
    # a pool sized to the request, not to gpu_memory_utilization: the four families run in one worker
    # process, and a pool sized from memory would keep the first one's share from the next
    llm = LLM(folder, dtype="float32", device="cuda", block_size=16,
              num_gpu_blocks=-(-(40 + GREEDY_STEPS) // 16) + 2)
    assert llm.engine.runner.graphs is not None
    prompt = [random.Random(seed).randrange(VOCAB) for _ in range(40)]
    ours = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert ours == _hf_greedy(hf, prompt, GREEDY_STEPS), family


# ---- the engine oracle: batched = alone ------------------------------------------------------------


def random_moe_model(rng: random.Random, mla: bool):
    """A small MoE model (Mixtral-like, or DeepSeek-V3-like with MLA) with random weights."""
    moe = MoEConfig(num_experts=8, num_experts_per_tok=rng.choice([2, 3]), moe_intermediate_size=24,
                    num_shared_experts=int(mla), scoring_func="sigmoid" if mla else "softmax",
                    topk_method="noaux_tc" if mla else "greedy", n_group=4 if mla else None,
                    topk_group=2 if mla else None, routed_scaling_factor=2.5 if mla else 1.0,
                    dense_layers=(0,) if mla else ())
    fields = dict(architecture="deepseek_v3" if mla else "mixtral", vocab_size=97, hidden_size=48,
                  intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=4 if mla else 2,
                  head_dim=8 if mla else 16, max_position_embeddings=256, moe=moe,
                  mla=MLAConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
                                q_lora_rank=rng.choice([None, 20])) if mla else None)
    config = ModelConfig(**fields)
    model, _, _ = load_model(config, load_format="dummy")
    gen = torch.Generator().manual_seed(rng.randrange(1 << 31))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.1 if "norm" in name else 0.3, generator=gen)
    return model, config


@pytest.mark.slow
@pytest.mark.parametrize("case", range(4))
def test_engine_matches_one_request_at_a_time(seed, tok, case):
    rng = random.Random(seed * 100 + case)
    model, config = random_moe_model(rng, mla=case >= 2)
    requests = random_requests(rng, config.vocab_size, rng.randrange(3, 7))
    expected = [alone(model, tok, p, sp) for p, sp in requests]
    block_size = rng.choice([1, 4, 16])
    ec = EngineConfig(block_size=block_size, num_gpu_blocks=blocks_for(requests, block_size) + 1 + rng.randrange(0, 6),
                      num_cpu_blocks=64, preemption_mode=["recompute", "swap"][case % 2],
                      enable_prefix_caching=["hash", "radix"][case % 2],
                      max_num_batched_tokens=rng.randrange(4, 24), max_num_seqs=rng.randrange(3, 7))
    engine = LLMEngine(model, tok, [], ec)
    padded = case % 2 == 1 and engine.runner.graphs is None  # the CUDA-graph steps' padding, run eagerly
    if padded:
        pad_steps_eagerly(engine)
    for i, (p, sp) in enumerate(requests):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
    got = {}
    while engine.has_unfinished_requests():
        got |= {o.request_id: [c.token_ids for c in o.outputs] for o in engine.step() if o.finished}
    assert [got[f"r{i}"] for i in range(len(requests))] == expected, ec
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks - 1
    if padded:
        assert replayed_both_kinds(engine)


# ---- bad checkpoints and configs -------------------------------------------------------------------


def _rewrite(folder, drop: str | None = None, add: str | None = None):
    """The checkpoint without tensor `drop`, or with a copy of a tensor under the name `add`."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)
    if drop is not None:
        del tensors[drop]
    if add is not None:
        tensors[add] = next(iter(tensors.values())).clone()
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def mixtral_folder(tmp_path_factory):
    return make_tiny("mixtral", tmp_path_factory.mktemp("mixtral-bad"))


def test_missing_expert_tensor_is_named(mixtral_folder, tmp_path):
    import shutil

    folder = shutil.copytree(mixtral_folder, tmp_path / "m")
    _rewrite(folder, drop="model.layers.1.block_sparse_moe.experts.5.w3.weight")
    with pytest.raises(ValueError, match=r"missing 1 tensor.*model\.layers\.1\.mlp\.experts\.w13\.weight:"
                                         r"block_sparse_moe\.experts\.5\.w3"):
        load_model(folder)


def test_extra_expert_tensor_is_named(mixtral_folder, tmp_path):
    import shutil

    folder = shutil.copytree(mixtral_folder, tmp_path / "m")
    _rewrite(folder, add="model.layers.0.block_sparse_moe.experts.8.w1.weight")  # 8 experts: 0..7
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.block_sparse_moe\.experts\.8\.w1\.weight' has no place"):
        load_model(folder)


def test_top_k_above_the_number_of_experts_is_refused(mixtral_folder, tmp_path):
    import shutil

    folder = shutil.copytree(mixtral_folder, tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | {"num_experts_per_tok": 9}))
    with pytest.raises(ValueError, match=r"config\.json: config moe\.num_experts_per_tok \(9\) must be <= "
                                         r"num_experts \(8\)"):
        load_model(folder)
    (folder / "config.json").write_text(json.dumps(cfg | {"scoring_func": "relu"}))
    with pytest.raises(ValueError, match="moe.scoring_func must be one of softmax, sigmoid, not 'relu'"):
        load_model(folder)


@pytest.mark.parametrize("name,billions", [("mixtral-8x7b", 46.7), ("qwen3-30b-a3b", 30.5), ("deepseek-v2-lite", 15.7)])
def test_presets_have_the_published_sizes(name, billions):
    """The dummy presets' shapes, built on the meta device: the parameter counts the model cards state."""
    from minillm.config import preset

    assert round(preset(name).num_params / 1e9, 1) == billions


def test_a_transformers_4_deepseek_config_reads_as_the_preset():
    """DeepSeek-V2-Lite's config.json as published (transformers 4 layout: rope_scaling with "type",
    no head_dim) gives the preset's config."""
    from minillm.config import preset

    cfg = {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 102400,
           "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
           "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64,
           "routed_scaling_factor": 1.0, "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64,
           "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
           "num_experts_per_tok": 6, "moe_layer_freq": 1, "first_k_dense_replace": 1, "norm_topk_prob": False,
           "scoring_func": "softmax", "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "rope_theta": 10000,
           "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                            "original_max_position_embeddings": 4096, "type": "yarn"},
           "tie_word_embeddings": False, "bos_token_id": 100000, "eos_token_id": 100001}
    got, want = ModelConfig.from_hf(cfg), preset("deepseek-v2-lite")
    assert got.mla == want.mla and got.head_dim == want.head_dim == 64
    assert got.moe.dense_layers == (0,) and got.moe.num_shared_experts == 2 and not got.moe.norm_topk_prob
    assert {k: v for k, v in got.rope_scaling.items() if k != "type"} == want.rope_scaling
    assert got.num_params == want.num_params
