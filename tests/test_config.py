"""CacheLayout's checks: a layout every process of a run would fail on is refused where it
is read (zkvrun's ``--config``, a rank's ``$ZKV_CONFIG``), in one line."""

from __future__ import annotations

import orjson
import pytest

from zkv.config import (
    DEFAULT_SCHEDULER_TIMEOUT_S,
    CacheLayout,
    check_rank_env,
    heartbeat_from_env,
    scheduler_timeout_from_env,
)
from zkv.errors import ConfigError

FIELDS = {"num_layers": 2, "kv_heads": 2, "block_size": 16, "head_dim": 64, "dtype": "float16",
          "num_device_blocks": 64, "num_host_blocks": 64, "world_size": 1}


@pytest.mark.parametrize("field,value,shown", [
    # Before, each was accepted: the ranks then died as "fatal error" and were restarted
    ("num_device_blocks", 64.5, "64.5"),
    ("num_device_blocks", True, "True"),  # bool is an int in Python: refused all the same
    ("num_host_blocks", "64", "'64'"),
    ("num_layers", 2.0, "2.0"),
    ("num_kv_parts", True, "True"),  # (True == 1 passed the "1 or 2" check)
    ("world_size", None, "None"),
])
def test_a_field_of_the_wrong_type_is_refused_by_name(field: str, value: object,
                                                      shown: str) -> None:
    text = orjson.dumps({**FIELDS, field: value})
    with pytest.raises(ConfigError) as e:
        CacheLayout.from_json(text)
    assert str(e.value) == f"bad cache layout JSON: {field} must be an int, got {shown}"


@pytest.mark.parametrize("field", ["dtype", "model", "kv_layout"])
def test_a_text_field_must_be_text(field: str) -> None:
    with pytest.raises(ConfigError, match=rf"^bad cache layout JSON: {field} must be a str, "
                                          r"got \['x'\]$"):
        CacheLayout.from_json(orjson.dumps({**FIELDS, field: ["x"]}))


def test_a_good_layout_round_trips_and_values_are_still_checked() -> None:
    layout = CacheLayout.from_json(orjson.dumps(FIELDS))
    assert CacheLayout.from_json(layout.to_json()) == layout
    with pytest.raises(ConfigError, match=r"^bad cache layout JSON: num_layers must be > 0, "
                                          r"got 0$"):
        CacheLayout.from_json(orjson.dumps({**FIELDS, "num_layers": 0}))
    with pytest.raises(ConfigError, match=r"^num_device_blocks must be an int, got 1.5$"):
        CacheLayout(1, 1, 1, 1, num_device_blocks=1.5)  # type: ignore[arg-type]


@pytest.mark.parametrize("env,message", [
    ({"ZKV_HEARTBEAT_S": "1e-9"}, "ZKV_HEARTBEAT_S must be a finite number of seconds in "
                                  "[0.01, 0.5], got '1e-9'"),
    ({"ZKV_HEARTBEAT_S": "nan"}, "ZKV_HEARTBEAT_S must be a finite number of seconds in "
                                 "[0.01, 0.5], got 'nan'"),
    ({"ZKV_HEARTBEAT_S": ""}, "ZKV_HEARTBEAT_S must be a finite number of seconds in "
                              "[0.01, 0.5], got ''"),  # (a rank refuses '' too)
    # past threading's TIMEOUT_MAX: the rank's heartbeat thread died (OverflowError) and
    # it beat no more; past a second: an idle rank lost under a 1 s heartbeat timeout
    ({"ZKV_HEARTBEAT_S": "1e10"}, "ZKV_HEARTBEAT_S must be a finite number of seconds in "
                                  "[0.01, 0.5], got '1e10'"),
    ({"ZKV_HEARTBEAT_S": "0.6"}, "ZKV_HEARTBEAT_S must be a finite number of seconds in "
                                 "[0.01, 0.5], got '0.6'"),
    # Python's float() reads "1_0" as 10: a typo of 1.0 was a heartbeat every 10 s
    ({"ZKV_HEARTBEAT_S": "1_0"}, "ZKV_HEARTBEAT_S must be a finite number of seconds in "
                                 "[0.01, 0.5], got '1_0'"),
    ({"ZKV_SCHEDULER_TIMEOUT_S": "3_0"}, "ZKV_SCHEDULER_TIMEOUT_S must be a finite number of "
                                         "seconds > 0, or inf to wait forever, got '3_0'"),
    ({"ZKV_SCHEDULER_TIMEOUT_S": "5m"}, "ZKV_SCHEDULER_TIMEOUT_S must be a finite number of "
                                        "seconds > 0, or inf to wait forever, got '5m'"),
    ({"ZKV_BACKEND": "tpu"}, "ZKV_BACKEND: unknown copy backend 'tpu'; one of 'auto', 'cupy', "
                             "'cpu', 'torch', 'torch-cpu'"),
])
def test_what_every_rank_reads_is_checked_without_starting_one(env: dict[str, str],
                                                               message: str) -> None:
    with pytest.raises(ConfigError) as e:
        check_rank_env(env)
    assert str(e.value) == message


def test_rank_env_values() -> None:
    check_rank_env({})
    assert heartbeat_from_env({}) == 0.25 and heartbeat_from_env({"ZKV_HEARTBEAT_S": "0.01"})
    assert scheduler_timeout_from_env({}) == DEFAULT_SCHEDULER_TIMEOUT_S
    assert scheduler_timeout_from_env({"ZKV_SCHEDULER_TIMEOUT_S": " Inf "}) is None
    assert scheduler_timeout_from_env({"ZKV_SCHEDULER_TIMEOUT_S": "2.5"}) == 2.5
