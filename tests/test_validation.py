"""Validation at construction: SamplingParams and engine options reject bad types and ranges.

Every rejection is a ValueError whose message names the field and the bad value, so a request
never reaches torch with a value that fails mid-run. No model is loaded here.
"""

import math
import re

import numpy as np
import pytest
import torch

from nanoserve.config import ENGINE_OPTIONS, EngineConfig, engine_config_for
from nanoserve.models.config import ModelConfig
from nanoserve.models.presets import preset_config
from nanoserve.sampling import SamplingParams, make_generator


def rejects(owner: type, field: str, value):
    """pytest.raises for a ValueError whose message says `Owner.field = repr(value) is invalid`."""
    return pytest.raises(
        ValueError, match=re.escape(f"{owner.__name__}.{field} = {value!r} is invalid")
    )


def model_config(max_position_embeddings: int = 4096) -> ModelConfig:
    d = preset_config("tiny-llama")
    d["max_position_embeddings"] = max_position_embeddings
    return ModelConfig.from_hf_dict(d)


# SamplingParams


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("top_k", 2.5),
        ("top_k", 2.0),
        ("top_k", "2"),
        ("top_k", True),
        ("max_tokens", 8.0),
        ("max_tokens", "8"),
        ("max_tokens", True),
        ("max_tokens", None),
        ("seed", 1.5),
        ("seed", "7"),
        ("seed", True),
        ("seed", torch.tensor(7)),
    ],
)
def test_an_int_field_given_a_float_str_or_bool_is_rejected_naming_the_field(field, value):
    with rejects(SamplingParams, field, value):
        SamplingParams(**{field: value})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", math.inf),
        ("temperature", -math.inf),
        ("temperature", math.nan),
        ("temperature", True),
        ("temperature", "0.7"),
        ("temperature", None),
        ("top_p", math.nan),
        ("top_p", math.inf),
        ("top_p", True),
        ("top_p", "0.9"),
    ],
)
def test_a_float_field_that_is_not_a_finite_number_is_rejected_naming_the_field(field, value):
    with rejects(SamplingParams, field, value):
        SamplingParams(**{field: value})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("top_k", 0),
        ("top_k", -1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("max_tokens", 0),
        ("max_tokens", -3),
    ],
)
def test_a_value_out_of_range_is_rejected_naming_the_field(field, value):
    with rejects(SamplingParams, field, value):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("value", [1, "yes", None, np.bool_(True)])
def test_ignore_eos_that_is_not_a_bool_is_rejected(value):
    with rejects(SamplingParams, "ignore_eos", value):
        SamplingParams(ignore_eos=value)


@pytest.mark.parametrize("seed", [0, 1, 2**63, 2**64 - 1])
def test_a_seed_in_the_unsigned_64_bit_range_is_accepted_and_seeds_a_generator(seed):
    params = SamplingParams(temperature=1.0, seed=seed)
    generator = make_generator(params, torch.device("cpu"))
    assert generator.initial_seed() == seed


@pytest.mark.parametrize("seed", [-1, -(2**63), 2**64, 2**80])
def test_a_seed_outside_the_unsigned_64_bit_range_is_rejected(seed):
    with rejects(SamplingParams, "seed", seed):
        SamplingParams(temperature=1.0, seed=seed)
    with pytest.raises(ValueError, match=re.escape("[0, 2**64)")):
        SamplingParams(seed=seed)


@pytest.mark.parametrize(
    "ids", [[5, 7], (5, 7), range(5, 8, 2), (i for i in (5, 7)), np.array([5, 7]), {5, 7}]
)
def test_stop_token_ids_accepts_any_iterable_of_ints_and_stores_a_tuple_of_ints(ids):
    params = SamplingParams(stop_token_ids=ids)
    assert sorted(params.stop_token_ids) == [5, 7]
    assert type(params.stop_token_ids) is tuple
    assert all(type(i) is int for i in params.stop_token_ids)
    assert 7 in params.stop_token_ids and 6 not in params.stop_token_ids  # how the scheduler asks


@pytest.mark.parametrize("value", [2, None, "12", b"\x01\x02", 2.5])
def test_stop_token_ids_that_is_not_an_iterable_of_ids_is_rejected_naming_the_value(value):
    with rejects(SamplingParams, "stop_token_ids", value):
        SamplingParams(stop_token_ids=value)


@pytest.mark.parametrize("ids", [[1, 2.0], [1, "2"], [True], [3, -1], [[1]]])
def test_stop_token_ids_with_an_element_that_is_no_token_id_is_rejected(ids):
    with rejects(SamplingParams, "stop_token_ids", tuple(ids)):
        SamplingParams(stop_token_ids=ids)


def test_ints_are_accepted_for_float_fields_and_numpy_numbers_become_python_numbers():
    params = SamplingParams(
        temperature=1,
        top_p=np.float32(0.5),
        top_k=np.int64(3),
        max_tokens=np.int32(4),
        seed=np.uint64(2**64 - 1),
    )
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens, params.seed) == (
        1.0,
        0.5,
        3,
        4,
        2**64 - 1,
    )
    assert [type(v) for v in (params.temperature, params.top_p)] == [float, float]
    assert [type(v) for v in (params.top_k, params.max_tokens, params.seed)] == [int, int, int]
    assert make_generator(params, torch.device("cpu")).initial_seed() == 2**64 - 1


def test_defaults_still_construct_and_the_params_stay_frozen():
    params = SamplingParams()
    assert (params.temperature, params.top_k, params.top_p, params.max_tokens) == (0, None, 1, 64)
    assert (params.ignore_eos, params.stop_token_ids, params.seed) == (False, (), None)
    with pytest.raises(AttributeError):
        params.top_k = 3


# EngineConfig and engine_config_for

COUNT_FIELDS = ["max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size"]
OPTIONAL_COUNT_FIELDS = ["num_slabs", "num_kv_blocks", "kv_cache_bytes"]


@pytest.mark.parametrize("field", COUNT_FIELDS + OPTIONAL_COUNT_FIELDS)
@pytest.mark.parametrize("value", [16.0, "16", True, 0, -1])
def test_an_engine_count_that_is_not_an_int_of_at_least_one_is_rejected(field, value):
    with rejects(EngineConfig, field, value):
        EngineConfig(**{field: value})


@pytest.mark.parametrize("field", COUNT_FIELDS)
def test_a_required_engine_count_of_none_is_rejected(field):
    with rejects(EngineConfig, field, None):
        EngineConfig(**{field: None})


@pytest.mark.parametrize("field", OPTIONAL_COUNT_FIELDS)
def test_an_optional_engine_count_takes_none_or_an_int_and_stores_a_python_int(field):
    assert getattr(EngineConfig(**{field: None}), field) is None
    value = getattr(EngineConfig(**{field: np.int64(32)}), field)
    assert value == 32 and type(value) is int


@pytest.mark.parametrize("value", [math.nan, math.inf, True, "0.5", None, 0, 0.0, 1.5, -0.5])
def test_gpu_memory_utilization_that_is_not_a_finite_share_is_rejected(value):
    with rejects(EngineConfig, "gpu_memory_utilization", value):
        EngineConfig(gpu_memory_utilization=value)


@pytest.mark.parametrize("value", [1, 1.0, 0.5, 1e-3])
def test_gpu_memory_utilization_in_zero_to_one_is_accepted(value):
    assert EngineConfig(gpu_memory_utilization=value).gpu_memory_utilization == value


@pytest.mark.parametrize("value", ["", "   ", None, 3, ["torch"]])
def test_attention_backend_that_is_not_a_non_empty_str_is_rejected(value):
    with rejects(EngineConfig, "attention_backend", value):
        EngineConfig(attention_backend=value)


def test_attention_backend_defaults_to_auto_and_takes_any_name_the_selector_will_check():
    assert EngineConfig().attention_backend == "auto"
    assert EngineConfig(attention_backend="torch").attention_backend == "torch"
    assert "attention_backend" in ENGINE_OPTIONS


def test_a_prefill_budget_below_max_model_len_is_still_rejected():
    with rejects(EngineConfig, "max_num_batched_tokens", 100):
        EngineConfig(max_model_len=200, max_num_batched_tokens=100)


def test_max_model_len_above_the_models_limit_is_rejected_with_both_numbers():
    with pytest.raises(
        ValueError, match=r"max_model_len = 1025 .*max_position_embeddings \(1024\)"
    ):
        engine_config_for(model_config(1024), max_model_len=1025)


def test_max_model_len_at_the_models_limit_is_accepted_and_the_default_stays_within_it():
    assert engine_config_for(model_config(1024), max_model_len=1024).max_model_len == 1024
    assert engine_config_for(model_config(1024)).max_model_len == 1024
    assert engine_config_for(model_config(40960)).max_model_len == 4096


@pytest.mark.parametrize("value", ["8", None, 2.5, True])
def test_engine_config_for_names_a_max_model_len_of_the_wrong_type(value):
    with rejects(EngineConfig, "max_model_len", value):
        engine_config_for(model_config(), max_model_len=value)


def test_a_misspelt_engine_option_is_rejected_listing_the_valid_names():
    with pytest.raises(ValueError, match="'max_num_seq' is not an engine option") as error:
        engine_config_for(model_config(), max_num_seq=8)
    assert "did you mean 'max_num_seqs'?" in str(error.value)
    assert all(name in str(error.value) for name in ENGINE_OPTIONS)


def test_engine_options_are_exactly_the_engine_config_fields():
    config = engine_config_for(
        model_config(), **{name: getattr(EngineConfig(), name) for name in ENGINE_OPTIONS}
    )
    assert config == EngineConfig()
