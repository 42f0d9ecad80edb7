"""Test tiers (docs/testing.md): each test is marked by what it starts, and `fast` goes on
every test that starts none of what the README's run leaves out.

tests/conftest.py applies these tables at collection; tests/test_tiers.py checks that every
test module is listed in MODULES, so a new module states what it starts before it runs.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest

# The marks a test can carry for what it starts (pyproject.toml says each in one line).
STARTS = ("process", "cluster", "browser", "vllm", "slow", "serial")

# What the fast tier, the README's `pytest -m fast`, leaves out; .ci/run runs them after it.
LEFT_OUT = ("slow", "cluster", "browser", "vllm")

# Tests with these marks run alone, also under pytest-xdist (tests/exclusive.py): a Ray
# cluster, gloo ranks or a vLLM server each take both cores, and `serial` tests measure time,
# memory or the host's shared state, which a neighbour in the next worker would disturb.
PARALLEL_UNSAFE = ("serial", "cluster", "vllm")

# Every test module (by file stem) with the marks of what its tests start.
MODULES: dict[str, tuple[str, ...]] = {
    "test_advantage_mass": ("process",),  # scripts/advantage_mass.py in a subprocess
    "test_advantages": (),
    "test_agent_settings": (),
    "test_architecture": ("process",),  # `git ls-files`, a fresh interpreter's imports
    "test_auto_mas": ("process",),  # designs run in the sandbox
    "test_auto_mas_harness": ("process",),  # designs in the sandbox; `masenvs sft`
    "test_baselines": (),
    "test_batch_invariant": (),
    "test_chat_templates": (),
    "test_check_env": (),
    "test_checkpoint": ("process",),  # a writer killed mid-write
    "test_cli_errors": ("process",),  # each command as a user runs it
    "test_client_builders": (),
    "test_code_env": ("process",),  # the sandbox
    "test_cold_start_pipeline": ("process", "slow"),  # the pipeline script: sft, train, eval
    "test_config": (),
    "test_cpu_kernels": ("process",),  # gcc builds the kernels
    "test_dist_learner": ("cluster",),  # torch.distributed ranks on gloo
    "test_demos": ("process",),  # a tool program in the sandbox
    "test_embedded": (),
    "test_endpoint": ("process",),  # `masenvs serve` killed with -9
    "test_engine_paths": ("process",),  # fresh interpreters import the old paths
    "test_engine_pool": ("process", "slow"),  # two `masenvs serve --engine` servers, trainings
    "test_engine_pool_vllm": ("vllm", "process"),
    "test_envs_contract": ("process",),  # the sandbox (code, verilog, tools)
    "test_evaluate": (),
    "test_fast_lora": (),
    "test_foreign_names": ("process",),  # `masenvs train` with a foreign name
    "test_frameworks_examples": ("process",),  # the shipped examples as scripts
    "test_frameworks_roles": ("serial", "slow"),  # times concurrent calls; trainings
    "test_frameworks_tools": (),
    "test_frameworks_workflow": ("process", "serial"),  # a program killed mid-call; timings
    "test_gymnasium": ("process",),
    "test_hub_models": (),
    "test_inference_plan": (),
    "test_integration_openenv": ("process",),  # `masenvs openenv-serve`
    "test_integration_trl": ("process", "slow"),  # `masenvs serve`, TRL trainings
    "test_integration_verifiers": ("process", "slow"),  # pytest in the verifiers venv: 43 s CPU
    "test_integrations_same_reward": ("process",),  # the sandbox (code, verilog)
    "test_integrity": ("process", "serial"),  # hostile clients; host shared-memory bounds
    "test_langgraph_state": ("process",),  # `masenvs train` in the agent's project
    "test_learner": (),
    "test_learner_flops": (),
    "test_learner_scale": (),
    "test_learning_configs": ("process",),  # the sandbox (code)
    "test_listener_hardening": ("process", "serial"),  # server memory and time under attack
    "test_listeners": ("process",),  # every server bound beyond loopback
    "test_loaders": ("process",),
    "test_loss": (),
    "test_mas": ("process",),  # hostile designs in the sandbox
    "test_mas_published": ("process",),  # tool code in the sandbox
    "test_math_env": ("process",),  # hostile programs in the sandbox
    "test_memory": ("process", "serial"),  # resident set sizes
    "test_metrics": (),
    "test_models": (),
    "test_options": (),
    "test_oracle_isolation": ("process", "serial"),  # timing and cache side channels
    "test_paper_configs": ("process",),  # scripts/check_train_gpu.py
    "test_paper_table": (),
    "test_paired_credit": ("process",),  # the sandbox runs the tool's programs
    "test_plan_path": (),
    "test_plan_path_success": (),
    "test_prefix": (),
    "test_progress": ("process",),  # train, rollout and eval as a user runs them
    "test_readme": (),
    "test_rl_sanity": ("slow",),  # trainings to a learned bandit
    "test_rollout_workers": ("cluster",),  # a local Ray cluster
    "test_sampling_knobs": (),
    "test_sandbox": ("process", "serial"),  # CPU-time and wall limits
    "test_sandbox_allowlist": ("process",),
    "test_sandbox_memory": ("process", "serial"),  # memory limits
    "test_sandbox_state": ("process", "serial"),  # page-cache side channels
    "test_scale_out": ("cluster", "process"),  # Ray, engine servers, gloo ranks
    "test_serving": (),
    "test_sft": ("process",),  # `masenvs sft`, `masenvs train --resume`
    "test_sokoban": (),
    "test_sudoku": (),
    "test_tiers": (),
    "test_traces": ("process",),  # a writer killed mid-record
    "test_training_warnings": (),
    "test_trajectory": (),
    "test_tree_rollout": (),
    "test_ui": ("browser", "process"),  # chromium, `masenvs ui`
    "test_ui_index": ("process",),
    "test_ui_diagnosis": (),
    "test_serve_adapters": ("process",),  # `masenvs serve` with adapters
    "test_unknown_models": ("process",),  # `masenvs serve`
    "test_validation_env_options": (),
    "test_verifiers": ("process",),  # tests/verifiers_env, in its own venv: `masenvs serve`
    "test_verilog_env": ("process",),  # iverilog in the sandbox
    "test_vllm_backend": ("process", "slow"),  # `masenvs serve --backend vllm`, stand-in servers
    "test_vllm_real": ("vllm", "process"),
    "test_web_search": ("process",),  # `masenvs search-serve`
    "test_wheel": ("process",),  # pip builds the wheel
    "test_workflow_training": (),
}

# Single tests ("module::function", all its parameters) that start more than their module.
TESTS: dict[str, tuple[str, ...]] = {
    "test_listeners::test_ray_workers_sample_through_a_keyed_endpoint_on_this_machines_address": (
        "cluster",
    ),
}

# The `slow` tests, by measurement (docs/testing.md, Times): each took over 4 s of CPU (its
# own and its children's, all parameters together) or 30 s of wall time beside a busy
# benchmark. A few cheaper tests over the line stay fast for what they show a newcomer: a
# training step in every env, `--help` without torch, this tier's own footer.
SLOW: frozenset[str] = frozenset(
    {
        "test_batch_invariant::test_a_prefill_token_gets_the_logits_a_decode_step_would",
        "test_batch_invariant::test_a_seeded_run_repeats_bit_for_bit",
        "test_batch_invariant::test_training_with_it_validates_the_same_weights_to_the_same_answers",
        "test_checkpoint::test_a_process_killed_mid_write_resumes_from_the_previous_checkpoint",
        "test_checkpoint::test_full_finetuning_resumes_exactly_and_saves_servable_models",
        "test_checkpoint::test_resume_gives_the_same_weights_as_an_uninterrupted_run",
        "test_client_builders::test_a_builder_taking_clients_trains_by_config_alone",
        "test_cli_errors::test_a_script_that_never_shuts_its_engine_down_exits_cleanly",
        "test_endpoint::test_kill_9_after_n_responses_keeps_all_n_in_the_store",
        "test_evaluate::test_a_checkpoint_is_scored_beside_its_base_model",
        "test_evaluate::test_full_model_checkpoints_per_role_are_evaluated_and_swapped",
        "test_evaluate::test_swap_scores_the_papers_100_held_out_tasks_greedily_unless_told_otherwise",
        "test_frameworks_examples::test_example_runs_and_takes_a_training_step",
        "test_frameworks_workflow::test_masenvs_rollout_runs_your_factory_against_masenvs_serve",
        "test_integration_openenv::test_docs_example_runs",
        "test_integration_openenv::test_the_command_stays_up_with_bounded_memory_under_100_hostile_sessions",
        "test_integration_openenv::test_trl_trains_on_the_server_as_the_docs_say",
        "test_integrity::test_a_step_saved_again_survives_a_kill_at_any_moment",
        "test_integrity::test_judges_refuse_a_sandbox_that_cannot_hide_the_tests",
        "test_langgraph_state::test_a_graph_with_its_own_state_trains_with_the_mapping_in_the_config",
        "test_learner_scale::test_chunked_logprobs_give_the_unchunked_loss_gradients_and_entropy",
        "test_listener_hardening::test_idle_connections_cannot_use_up_the_file_descriptors_of_serve",
        "test_listeners::test_an_engine_server_beyond_loopback_needs_a_key",
        "test_models::test_smollm2_answers_coherently",
        "test_paper_configs::test_gpu_check_rehearsal_on_cpu",
        "test_paper_configs::test_gpu_rehearsal_runs_every_paper_config_on_cpu",  # the same run
        "test_paper_configs::test_paper_config_trains_two_tiny_steps",
        "test_plan_path_success::test_a_workflow_training_run_reports_the_rates_in_metrics_jsonl",
        "test_prefix::test_feeding_the_prefix_once_changes_no_loss_and_no_gradient",
        "test_prefix::test_the_scoring_passes_feed_the_prefix_once_too",
        "test_progress::test_a_training_run_in_a_log_names_each_phase_as_it_starts",
        "test_progress::test_rollout_and_eval_say_what_they_load_before_it_is_loaded",
        "test_serving::test_separate_bases_serve_each_agent_from_its_own_base",
        "test_auto_mas_harness::test_the_authors_sft_trains_every_token_with_a_rank_64_adapter",
        "test_sft::test_full_sft_learns_the_replies",
        "test_sft::test_sft_lowers_the_loss_and_train_resumes_from_its_adapters",
        "test_serve_adapters::test_serve_warms_every_adapter_before_it_says_ready",
        "test_unknown_models::test_serve_answers_an_unknown_model_with_404_naming_the_known_ones",
        "test_unknown_models::test_serve_unknown_agents_base_answers_any_name",
        "test_unknown_models::test_the_banner_snippet_asks_for_the_served_agent",
    }
)


def marks_of(module: str, function: str) -> set[str]:
    """The tier marks of one test: its module's, and its own from TESTS and SLOW."""
    name = f"{module}::{function}"
    return {*MODULES.get(module, ()), *TESTS.get(name, ()), *(("slow",) if name in SLOW else ())}


def classify(items: Iterable[pytest.Item]) -> None:
    """Add each test's tier marks, and `fast` where it has none of LEFT_OUT."""
    for item in items:
        module = item.path.stem
        function = getattr(item, "originalname", item.name)
        have = {m.name for m in item.iter_markers()}
        for name in sorted(marks_of(module, function) - have):
            item.add_marker(name)
            have.add(name)
        if not have & set(LEFT_OUT):
            item.add_marker("fast")


def left_out_counts(deselected: Iterable[pytest.Item]) -> dict[str, int]:
    """How many tests of each tier a run left out."""
    counts = dict.fromkeys(LEFT_OUT, 0)
    for item in deselected:
        for tier in LEFT_OUT:
            counts[tier] += item.get_closest_marker(tier) is not None
    return counts


def left_out_summary(counts: dict[str, int]) -> list[str]:
    """One line per tier a run left out: how many tests, and the command that runs them."""
    if not any(counts.values()):
        return []  # a -k or a file named: nothing of a tier was left out
    lines = ["left out of this run (docs/testing.md):"]
    lines += [f"  {n:4d} {tier:<8} pytest -m {tier}" for tier, n in counts.items() if n]
    lines.append("  all of them: pytest -m 'not fast'; everything: pytest")
    return lines
