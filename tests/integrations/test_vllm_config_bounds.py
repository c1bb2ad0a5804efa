"""``kv_connector_extra_config`` values at the edges: each one line, never a traceback nor
a setting read as another."""

from __future__ import annotations

import re
from typing import Any

import pytest

from zkv.errors import ConfigError
from zkv.integrations.vllm.check import check
from zkv.integrations.vllm.config import parse_extra_config

HUGE = 10**400  # Python's json.loads (vLLM's --kv-transfer-config) keeps it an int
NO_STORE = {"ZKV_STORE_URL": "none"}


@pytest.mark.parametrize("extra, msg", [
    ({"write_through_threshold": HUGE}, "write_through_threshold must be a finite number"),
    ({"metrics_port": HUGE}, "metrics_port must be a finite number"),
    ({"inject_rank": HUGE}, "inject_rank must be a finite number"),
    ({"host_bytes": "1" * 400 + "GiB"}, "host_bytes must be at most"),  # float() is inf
    ({"host_bytes": "1" * 400}, "host_bytes must be at most"),
    ({"host_bytes": HUGE}, "host_bytes must be at most"),
    ({"host_bytes": "99999999999999999999TiB"}, "host_bytes must be at most"),
    ({"host_blocks": HUGE}, "host_blocks must be > 0 and <= "),
])
def test_a_huge_number_is_one_line_not_an_overflow_traceback(extra: dict[str, Any],
                                                             msg: str) -> None:
    """Before: ``OverflowError: int too large to convert to float`` (or ``cannot convert
    float infinity to integer``) from the parse, or a host_blocks past any machine taken
    and an OverflowError from the memory check's message at start."""
    with pytest.raises(ConfigError, match=msg) as e:
        parse_extra_config(extra, NO_STORE)
    assert "\n" not in str(e.value) and str(e.value).startswith("zkv: ")
    assert len(str(e.value)) < 300  # the 400 digits are not echoed whole


def test_the_check_script_says_a_huge_host_bytes_in_one_line() -> None:
    with pytest.raises(ConfigError, match="host_bytes must be at most"):
        check('{"storage": "none", "host_bytes": "%sTiB"}' % ("9" * 400))


def test_the_largest_pool_sizes_still_parse() -> None:
    from zkv.integrations.vllm.config import MAX_POOL_SIZE

    assert parse_extra_config({"host_blocks": MAX_POOL_SIZE}, NO_STORE).host_blocks == \
        MAX_POOL_SIZE
    assert parse_extra_config({"host_bytes": "4GiB"}, NO_STORE).host_bytes == 4 << 30


@pytest.mark.parametrize("log_dir", ["", "  "])
def test_an_empty_log_dir_is_refused_not_taken_for_stderr(log_dir: str) -> None:
    """``log_dir: ""`` passed the check (no such path: its parent is writable) and the
    loggers took it for no key: the logs went to stderr (or ``$ZKV_LOG_DIR``), silently,
    where ``storage: ""`` is refused."""
    with pytest.raises(ConfigError, match="zkv: log_dir is empty"):
        parse_extra_config({"log_dir": log_dir}, NO_STORE)


@pytest.mark.parametrize("extra, msg", [
    # a NUL passed the checks, then every connector process's start was a ValueError
    # traceback ("embedded null byte")
    ({"log_dir": "/tmp/zkv\0logs"}, "log_dir holds a control character"),
    ({"namespace_salt": "run\n2"}, "namespace_salt holds a control character"),
    # other scripts' digits (\d) were sizes: "٤GiB" was 4 GiB
    ({"host_bytes": "\u0664GiB"}, "host_bytes"),
    # keys the configuration does not read changed nothing and said nothing
    ({"write_through_threshold": 3}, "write_through_threshold is read by policy "
                                     "write_through_selective only (the policy is "
                                     "write_through)"),
    ({"prefetch": "best_effort", "prefetch_base_ms": 10}, "prefetch_base_ms is read by "
                                                          "prefetch timeout only"),
    ({"inject_rank": 1}, "inject_rank is read with inject_load_failures only"),
])
def test_a_value_no_setting_takes_is_one_line(extra: dict[str, Any], msg: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(msg)):
        parse_extra_config(extra, NO_STORE)


def test_the_keys_read_with_their_settings_still_parse() -> None:
    cfg = parse_extra_config({"policy": "write_through_selective", "write_through_threshold": 3,
                              "prefetch": "timeout", "prefetch_base_ms": 10,
                              "inject_load_failures": [1], "inject_rank": 1}, NO_STORE)
    assert (cfg.write_through_threshold, cfg.prefetch_base_ms, cfg.inject_rank) == (3, 10, 1)
