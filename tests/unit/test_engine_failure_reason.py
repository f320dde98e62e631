"""What a trial that vLLM refused or that crashed records as its reason (engine/server.telling_error)."""

from servetune.engine.server import telling_error


def test_a_refused_configuration_says_what_pydantic_refused():
    refused = (
        "INFO 12-06 api_server.py:1] vLLM API server version 0.32.0\n"
        "ValueError: an earlier error\n"
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for SchedulerConfig\n"
        "  Value error, long_prefill_token_threshold (1024) cannot be greater than the max_model_len (512)."
        " [type=value_error, input_value=ArgsKwargs((), {'runner_t..., 'stream_interval': 1}), input_type=ArgsKwargs]\n"
        "    For further information visit https://errors.pydantic.dev/2.14/v/value_error\n"
        "INFO 12-06 shutting down\n"
    )
    assert telling_error(refused) == (
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for SchedulerConfig: Value error, "
        "long_prefill_token_threshold (1024) cannot be greater than the max_model_len (512)."
    )


def test_a_refused_field_is_named_and_two_refusals_are_both_said():
    field = (  # vLLM 0.32's CPU build, `vllm serve --block-size 0`
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for CacheConfig\n"
        "block_size\n"
        "  Input should be greater than 0 [type=greater_than, input_value=0, input_type=int]\n"
        "    For further information visit https://errors.pydantic.dev/2.14/v/greater_than\n"
    )
    assert telling_error(field) == (
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for CacheConfig: "
        "block_size Input should be greater than 0"
    )
    two = "ValidationError: 2 validation errors for X\n  a is wrong [type=x]\nb\n  b is wrong\nINFO after\n  indented"
    assert telling_error(two) == "ValidationError: 2 validation errors for X: a is wrong; b b is wrong"


def test_a_crash_is_its_last_error_line_and_a_quiet_log_points_to_the_tail():
    crashed = "  File x.py, line 3\nValueError: first\nRuntimeError: No common block size for 7\nINFO done\n"
    assert telling_error(crashed) == "RuntimeError: No common block size for 7"
    assert telling_error("INFO nothing wrong here\n") == "see the log tail"


def test_a_worker_crash_is_the_cause_not_the_engine_cores_pointer_to_it():
    crashed = (  # vLLM 0.32's CPU build, `vllm serve --block-size 7` (abridged)
        "(APIServer pid=1) WARNING 12-06 20:07:24 [system_utils.py:255] fd limit errors like `OSError: [Errno 24]`\n"
        "(Worker pid=3) ERROR [multiproc_executor.py:1063] ValueError: No common block size for 7 (CPU_ATTN).\n"
        "(EngineCore pid=2) ERROR [core.py:1510] RuntimeError: Worker failed with error 'No common block size for 7"
        " (CPU_ATTN).', please check the stack trace above for the root cause\n"
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n"
    )
    assert telling_error(crashed).endswith("] ValueError: No common block size for 7 (CPU_ATTN).")
    killed = (  # a worker killed without an error line of its own: the pointer, not the warning above it
        "(APIServer pid=1) WARNING 12-06 20:07:24 [system_utils.py:255] fd limit errors like `OSError: [Errno 24]`\n"
        "(EngineCore pid=2) ERROR 12-06 20:07:41 [core.py:1] Worker proc 3 died unexpectedly\n"
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n"
    )
    assert telling_error(killed).startswith("RuntimeError: Engine core initialization failed.")
    only_pointer = "RuntimeError: Engine core initialization failed. See root cause above.\n"
    assert telling_error(only_pointer) == only_pointer.strip()  # nothing else to say: the pointer, not nothing


def test_many_refusals_keep_the_heading_and_cut_what_it_heads():
    many = "ValidationError: 9 validation errors for X\n" + "".join(
        f"  field {i} is wrong{'!' * 40}\n" for i in range(9)
    )
    reason = telling_error(many)
    assert reason.startswith("ValidationError: 9 validation errors for X: field 0 is wrong") and len(reason) == 300
