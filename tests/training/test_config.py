"""`TrainConfig`, the one definition of a training run's settings, and the places it reaches:
the C++ loop's options, stored records, and its own checks."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

import cartridges_core
from cartridges.selfstudy.config import CORE_TRAINING_FIELDS, TrainConfig, describe
from cartridges.training import train_options


def test_the_core_loop_defaults_are_the_configs():
    """A TrainOptions made in C++ with nothing set trains as TrainConfig's defaults say for a
    document within the context, so no caller of the core meets other defaults."""
    core, config = cartridges_core.TrainOptions(), TrainConfig().for_corpus(2_500)
    for name in CORE_TRAINING_FIELDS:
        assert getattr(core, name) == getattr(config, name), name


def test_every_core_field_is_handed_over():
    changed = {"learning_rate": 0.5, "anchor": 1.0, "epochs": 7, "batch_size": 3, "grad_accum": 5, "cosine": False,
               "warmup": 0.25, "layer_scaled_lr": False, "channel_scaled_lr": False, "loss_weighting": "token",
               "seed": 11}
    assert set(changed) == set(CORE_TRAINING_FIELDS)
    options = train_options(TrainConfig(**changed))
    assert {name: getattr(options, name) for name in CORE_TRAINING_FIELDS} == changed


def test_the_learning_rate_has_one_name_and_reads_its_old_one():
    assert "lr" not in TrainConfig().to_dict() and TrainConfig().to_dict()["learning_rate"] == 0.02
    assert TrainConfig(lr=0.1).learning_rate == 0.1  # scripts and records that say lr
    assert TrainConfig.from_dict({"lr": 0.1, "a_field_since_removed": 1}).learning_rate == 0.1
    with pytest.raises(ValidationError, match="twice"):
        TrainConfig.model_validate({"lr": 0.1, "learning_rate": 0.2})


@pytest.mark.parametrize("values, field", [
    ({"epochs": 0}, "epochs"),
    ({"epochs": True}, "epochs"),  # a boolean is no number of epochs
    ({"epochs": "2"}, "epochs"),
    ({"num_samples": 2.5}, "num_samples"),
    ({"init": "zeros"}, "init"),
    ({"warmup": 1.0}, "warmup"),
    ({"learning_rate": 0}, "learning_rate"),
    ({"written_fraction": 1.5}, "written_fraction"),
    ({"num_epochs": 2}, "num_epochs"),
    ({"learning_rate": float("inf")}, "learning_rate"),  # JSON as Python reads it holds Infinity and NaN
    ({"answer_temperature": float("nan")}, "answer_temperature"),
    ({"num_tokens": 2**31}, "num_tokens"),  # past the core's 32-bit counts
    ({"seed": 2**63}, "seed"),  # past its 64-bit seed
])
def test_bad_values_are_refused_naming_the_field(values, field):
    with pytest.raises(ValidationError) as error:
        TrainConfig.model_validate(values)
    assert describe(error.value).startswith(f"{field}: ")


def test_a_seed_may_use_64_bits():
    assert TrainConfig(seed=2**40).seed == 2**40


def test_rules_across_fields():
    with pytest.raises(ValidationError, match="num_frozen must be below num_tokens"):
        TrainConfig(num_tokens=8, num_frozen=8)
    with pytest.raises(ValidationError, match="anchor"):
        TrainConfig(anchor=50.0)
    assert TrainConfig(learning_rate=1, num_samples=64).quality_samples == 8  # an int is a float; and follows


def test_a_config_is_a_value():
    config = TrainConfig()
    with pytest.raises(ValidationError):
        config.epochs = 3  # frozen: a config handed around cannot change under its holder
    assert config.replace(epochs=3).epochs == 3 and config.epochs is None
    with pytest.raises(ValidationError):
        config.replace(epochs=0)  # replace validates like construction
    decided = config.for_corpus(17_000)
    assert decided.for_corpus(17_000) is decided  # deciding again changes nothing
    assert TrainConfig.from_dict(decided.to_dict()) == decided
