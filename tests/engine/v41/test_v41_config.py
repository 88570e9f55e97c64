"""V4.1 config: the official nested layout, layer roles, layout invariants, real-config sizes."""

from __future__ import annotations

import copy

import pytest

from deepinfer.engine.loader.config_fields import ModelConfigError
from deepinfer.engine.models.deepseek_v41.config import V41Config
from deepinfer.engine.models.deepseek_v41.sizes import cache_sizes

REAL = V41Config()


def _dict(**text_changes):
    d = copy.deepcopy(REAL.to_dict())
    d["text_config"].update(text_changes)
    return d


def test_real_config_roles():
    roles = REAL.roles
    assert [r.layer for r in roles if r.name == "full"] == [2, 8, 14, 20]
    assert [r.layer for r in roles if r.name == "reindex"] == [24, 28, 32, 36]
    assert [r.layer for r in roles if r.name == "window"] == [0, 1]
    assert {r.kv_source for r in roles[20:]} == {20} and {r.ratio for r in roles[2:20]} == {2}
    assert [r.layer for r in roles if r.uses_candidates] == [24, 28, 32, 36]
    assert roles[20].is_candidate_source and REAL.ced_source == 20
    assert roles[27].index_source == 24 and roles[13].kv_source == 8
    assert [r.layer for r in roles if r.has_engram] == [1, 14]


def test_official_layout_round_trips():
    d = REAL.to_dict()
    assert d["model_type"] == "deepseek_v41" and d["architectures"] == ["DeepseekV41ForCausalLM"]
    assert len(d["text_config"]["compress_ratios"]) == 43 and d["quantization_config"]["weight_block_size"] == [32, 32]
    assert V41Config.from_dict(d) == REAL
    flat = {**{k: v for k, v in d.items() if k != "text_config"}, **d["text_config"], "model_type": "deepseek_v41"}
    assert V41Config.from_dict(flat) == REAL  # text keys at the top level, as vLLM flattens them


def test_real_config_cache_sizes():
    sizes = cache_sizes(REAL)
    assert sizes.global_bytes_per_token == 890  # 3 x (288 + 68) / 2 + (288 + 68)
    assert (sizes.persisted_layers, sizes.slot_rows, sizes.window_row_bytes) == (20, 134, 528)
    assert sizes.slot_bytes == 1_415_040
    assert sizes.float_bytes_per_token == 3200


def test_engram_tables_match_their_primes():
    """The released engram_num_embeddings are the sums of each layer's 24 hash primes."""
    V41Config.from_dict(_dict())
    bad = REAL.engram_num_embeddings[0] + 1
    with pytest.raises(ModelConfigError, match="engram_num_embeddings.*layer 1 384006169 table rows"):
        V41Config.from_dict(_dict(engram_num_embeddings=[bad, REAL.engram_num_embeddings[1]]))


@pytest.mark.parametrize("changes, message", [
    (dict(compress_ratios=[0] * 42), "has 42 entries; num_hidden_layers \\+ num_nextn_predict_layers = 40 \\+ 3"),
    (dict(compress_ratios=[0, 0] + [4] * 18 + [1] * 20 + [0] * 3), "ratio 0, 1 or 2"),
    (dict(compress_ratios=[0, 0] + [2] * 18 + [1] * 20 + [0, 1, 0]), "DSpark stages attend their window only"),
    (dict(kv_source_layer_ids=[3, 8, 14, 20]), "first compressed layer \\(2\\) must be a kv source"),
    (dict(kv_source_layer_ids=[2, 8, 14, 21], index_source_layer_ids=[2, 8, 14, 21, 24, 28, 32, 36]),
     "layer 20 has ratio 1 but reads kv source 14 of ratio 2"),
    (dict(index_source_layer_ids=[2, 8, 20, 24, 28, 32, 36]), "kv source 14 must be an index source"),
    (dict(kv_source_layer_ids=[2, 8, 14, 20, 41]), "not a compressed backbone layer"),
    (dict(candidate_source_layer_id=23), "candidate_source_layer_id 23 must be an index source"),
    (dict(candidate_source_layer_id=14), "index source 20 scores inside the candidate pool of layer 14"),
    (dict(index_topk=2048 * 8), "index_topk"),
    (dict(num_key_value_heads=8), "num_key_value_heads"),
    (dict(norm_topk_prob=False), "norm_topk_prob"),
    (dict(dspark_target_layer_ids=[37, 40]), "dspark_target_layer_ids"),
])
def test_layout_invariants_fail_with_clear_errors(changes, message):
    with pytest.raises(ModelConfigError, match=message):
        V41Config.from_dict(_dict(**changes))


def test_wrong_model_type_and_missing_ratios():
    with pytest.raises(ModelConfigError, match="model_type is 'deepseek_v4'"):
        V41Config.from_dict({**REAL.to_dict(), "model_type": "deepseek_v4"})
    d = _dict()
    del d["text_config"]["compress_ratios"]
    with pytest.raises(ModelConfigError, match="compress_ratios' is required"):
        V41Config.from_dict(d)
