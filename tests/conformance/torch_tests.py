"""Which of torch's distributed tests (`DistributedTest._DistTestBase` in
`torch.testing._internal.distributed.distributed_test`) the conformance runner runs against
backend "braid", which it leaves out and why. Pure data and two functions: importing this file
imports nothing of torch.

The lists were made on torch 2.13.0 (CPU), 2 ranks, by running every test of the collective and
point-to-point families (and every DDP test) with backend gloo and then braid, through
`runner.py`. A name that a given torch lacks comes out "n/a" in the runner's table.

- CPU_CI: the tests gloo passes on CPU with 2 ranks (the profiler copies of the send/recv tests
  included: on CPU torch's profiler-event checks apply to braid too, see runner.py); runs in CI
  (tests/test_conformance.py).
- CPU_FULL: CPU_CI plus the process-group API tests (get_rank, destroy_group...), for `--full`.
- CUDA: for `--device cuda` (NCCL reference, braid with its GPU lanes; ranks share the GPUs where
  there are fewer than ranks). Results on one shared GPU: docs/conformance.md.
- EXCLUDED: every test of the collective/p2p/DDP families that is in no list, with the reason.
- LIFTED: torch's name-based skips (decorators that compare BACKEND with "gloo", "nccl"...)
  that the runner removes, for the reference backend too, each with the check it overrides.
- REFERENCE_BODY: tests whose *body* (not a decorator) picks its set-up by the backend's name
  and does nothing for any other name; in their ranks the runner shows the test the reference
  backend's name once the braid group is made, so the body takes the reference path while every
  call still goes to braid's group.
- KNOWN_FAILURES: tests braid fails where the reference passes, not fixable now, with the reason.
"""
from __future__ import annotations

import os

FULL_ENV = "BRAID_CONFORMANCE_FULL"

# The families: a test of _DistTestBase whose name starts with one of these (or holds "_object")
# is in a list or in EXCLUDED; tests/test_conformance.py checks it on the torch the lists were
# made with.
FAMILY_PREFIXES = (
    "test_all_reduce", "test_reduce", "test_all_gather", "test_gather", "test_scatter",
    "test_broadcast", "test_all_to_all", "test_send_recv", "test_isend", "test_irecv",
    "test_batch_isend_irecv", "test_barrier", "test_coalescing_manager", "test_sparse_all_reduce",
    "test_monitored_barrier", "test_nccl_backend_bool", "test_DistributedDataParallel",
    "test_SyncBatchNorm", "test_ddp", "test_accumulate_gradients", "test_get_future",
    "test_grads_same_across_ranks", "test_static_graph", "test_sync_bn", "test_stateless_api_with_ddp",
    "test_detect_ddp", "test_dump_DDP",
)
LISTS_MADE_WITH = "2.13"     # torch major.minor the lists (and the completeness check) refer to


def in_families(name: str) -> bool:
    return name.startswith(FAMILY_PREFIXES) or "_object" in name


# ---------------------------------------------------------------------------------------------
# CPU: gloo is the reference
# ---------------------------------------------------------------------------------------------

CPU_CI = """
test_all_reduce_sum test_all_reduce_sum_async test_all_reduce_sum_complex test_all_reduce_product
test_all_reduce_min test_all_reduce_max test_all_reduce_complex_unsupported_ops
test_all_reduce_full_group_sum test_all_reduce_full_group_product test_all_reduce_full_group_min
test_all_reduce_full_group_max
test_all_reduce_coalesced_sum test_all_reduce_coalesced_product test_all_reduce_coalesced_min
test_all_reduce_coalesced_max test_all_reduce_coalesced_max_complex_unsupported
test_all_reduce_coalesced_full_group_sum test_all_reduce_coalesced_full_group_product
test_all_reduce_coalesced_full_group_min test_all_reduce_coalesced_full_group_max
test_sparse_all_reduce_sum
test_reduce_sum test_reduce_product test_reduce_min test_reduce_max test_reduce_sum_twice
test_reduce_full_group_sum test_reduce_full_group_product test_reduce_full_group_min
test_reduce_full_group_max
test_all_gather test_all_gather_complex test_all_gather_full_group
test_all_gather_coalesced_simple test_all_gather_coalesced_complex
test_all_gather_coalesced_full_group test_all_gather_coalesced_with_empty
test_gather test_gather_checks test_gather_full_group
test_scatter test_scatter_checks test_scatter_complex test_scatter_full_group
test_broadcast test_broadcast_full_group
test_all_to_all_single_equal_split test_all_to_all_single_equal_split_complex
test_all_to_all_single_equal_split_full_group test_all_to_all_single_unequal_split
test_all_to_all_single_unequal_split_complex test_all_to_all_single_unequal_split_full_group
test_send_recv test_send_recv_with_tag test_send_recv_any_source test_isend test_irecv
test_send_recv_autograd_profiler test_send_recv_torch_profiler
test_send_recv_with_tag_autograd_profiler test_send_recv_with_tag_torch_profiler
test_send_recv_any_source_autograd_profiler test_send_recv_any_source_torch_profiler
test_isend_autograd_profiler test_isend_torch_profiler
test_batch_isend_irecv_gloo test_batch_isend_irecv_gloo_tags
test_barrier test_barrier_full_group test_barrier_timeout_full_group
test_all_gather_object_default_pg test_all_gather_object_subgroup test_scatter_object_list
test_DistributedDataParallelCPU test_DistributedDataParallelCPU_grad_is_view
test_DistributedDataParallel_requires_grad test_ddp_create_graph test_ddp_logging_data_cpu
test_static_graph_api_cpu test_dump_DDP_relevant_env_vars test_get_future
test_grads_same_across_ranks_with_no_sync
test_accumulate_gradients_no_sync test_accumulate_gradients_no_sync_grad_is_view
test_accumulate_gradients_no_sync_allreduce_hook test_accumulate_gradients_no_sync_allreduce_with_then_hook
""".split()

CPU_FULL = CPU_CI + """
test_get_rank test_get_rank_size_full_group test_get_rank_size_group test_get_backend
test_destroy_group test_destroy_full_group test_Backend_enum_class
""".split()

# CPU, 8 ranks: the subgroup tests (torch runs them only from 8 ranks, `skip_if_small_worldsize`);
# their groups are made with new_group() under the braid default, so they check braid's subgroups
GROUP_WORLD = 8
CPU_GROUP = """
test_all_reduce_group_sum test_all_reduce_group_product test_all_reduce_group_min test_all_reduce_group_max
test_all_reduce_coalesced_group_sum test_all_reduce_coalesced_group_product test_all_reduce_coalesced_group_min
test_all_reduce_coalesced_group_max test_reduce_group_sum test_reduce_group_product test_reduce_group_min
test_reduce_group_max test_all_gather_group test_all_gather_coalesced_group test_gather_group test_scatter_group
test_broadcast_group test_all_to_all_single_equal_split_group test_all_to_all_single_unequal_split_group
test_barrier_group test_barrier_timeout_group
""".split()

# ---------------------------------------------------------------------------------------------
# CUDA: NCCL is the reference (results in docs/conformance.md)
# ---------------------------------------------------------------------------------------------

CUDA = """
test_all_reduce_sum_cuda test_all_reduce_sum_cuda_async test_all_reduce_sum_cuda_complex
test_reduce_sum_cuda test_reduce_sum_cuda_twice
test_all_gather_cuda test_all_gather_cuda_complex test_all_gather_into_cat_tensor_cuda
test_all_gather_into_stack_tensor_cuda test_all_gather_v_cuda
test_reduce_scatter_tensor_cuda test_reduce_scatter_v_cuda
test_gather_cuda test_scatter_cuda test_scatter_cuda_complex test_broadcast_cuda
test_all_to_all_cuda test_all_to_all_cuda_complex test_all_to_all_full_group_cuda
test_all_to_all_single_equal_split_cuda test_all_to_all_single_equal_split_cuda_complex
test_all_to_all_single_equal_split_full_group_cuda test_all_to_all_single_unequal_split_cuda
test_all_to_all_single_unequal_split_cuda_complex test_all_to_all_single_unequal_split_full_group_cuda
test_send_recv_nccl test_batch_isend_irecv_nccl test_batch_isend_irecv_ring_exchange_nccl
test_batch_isend_irecv_self_nccl test_batch_isend_irecv_no_rank_zero_nccl
test_nccl_backend_bool_allreduce test_nccl_backend_bool_allgather test_nccl_backend_bool_broadcast
test_nccl_backend_bool_reduce
test_barrier_cuda test_barrier_full_group_cuda
test_all_gather_object_default_pg test_all_gather_object_subgroup
test_DistributedDataParallel_requires_grad test_ddp_create_graph test_get_future
test_accumulate_gradients_no_sync test_ddp_hook_parity_allreduce test_ddp_broadcast_buffer
test_ddp_uneven_inputs test_ddp_logging_data_gpu
""".split()

# ---------------------------------------------------------------------------------------------
# Left out (CPU, 2 ranks): every collective/p2p/DDP test in no list, and why
# ---------------------------------------------------------------------------------------------

_SMALL_WORLD = "needs 3 or more ranks (torch skips it at 2 ranks, for gloo too)"
_CUDA = "needs CUDA (torch skips it on CPU for gloo too); see CUDA"
_NCCL_ONLY = "tests an NCCL-only feature or CUDA tensors (torch skips it for gloo); see CUDA"
_TWO_GPUS = "needs 2 GPUs (torch skips it on CPU for gloo too)"
_WORLD_4 = "needs exactly 4 ranks (torch skips it at 2 ranks, for gloo too)"
_TORCH_SKIPS = "torch skips it for every backend (an open problem of the test itself)"
_MONITORED = ("tests dist.monitored_barrier, a gloo-only feature: torch refuses any other group "
              "('monitored_barrier is only implemented for GLOO backend')")
_A2A_LIST = ("list all_to_all with unequal chunk sizes: gloo fails it too ('ProcessGroupGloo::alltoall: "
             "invalid tensor size'); braid hands list all_to_all to gloo")


def _each(names: str, why: str) -> dict[str, str]:
    return {n: why for n in names.split()}


EXCLUDED: dict[str, str] = {
    # the subgroup tests run in CPU_GROUP (8 ranks), but these
    "test_all_to_all_group": ("list all_to_all on a subgroup: torch skips it at 8 CPU ranks for gloo too "
                              "('Only MPI supports CPU all_to_all')"),
    **_each("test_barrier_group_cuda test_barrier_full_group_cuda", "needs CUDA and 8 GPUs (torch skips it on CPU)"),
    **_each("""test_all_reduce_sum_cuda test_all_reduce_sum_cuda_async test_all_reduce_sum_cuda_complex
        test_barrier_cuda test_broadcast_cuda test_sparse_all_reduce_sum_cuda test_ddp_logging_data_gpu
        test_DistributedDataParallel_SyncBatchNorm test_DistributedDataParallel_SyncBatchNorm_2D_Input
        test_DistributedDataParallel_SyncBatchNorm_Channels_Last
        test_DistributedDataParallel_SyncBatchNorm_Diff_Input_Sizes_Running_Value
        test_DistributedDataParallel_SyncBatchNorm_Diff_Input_Sizes_gradient
        test_DistributedDataParallel_SyncBatchNorm_No_Affine
        test_DistributedDataParallel_SyncBatchNorm_Single_Input_Per_Process
        test_DistributedDataParallel_SyncBatchNorm_half test_DistributedDataParallel_with_amp_and_grad_is_view""",
            _CUDA),
    **_each("""test_all_gather_cuda test_all_gather_cuda_complex test_all_gather_into_cat_tensor_cuda
        test_all_gather_into_stack_tensor_cuda test_all_gather_v_cuda test_all_to_all_cuda
        test_all_to_all_cuda_complex test_all_to_all_full_group_cuda test_all_to_all_group_cuda
        test_all_to_all_single_equal_split_cuda test_all_to_all_single_equal_split_cuda_complex
        test_all_to_all_single_equal_split_full_group_cuda test_all_to_all_single_equal_split_group_cuda
        test_all_to_all_single_unequal_split_cuda test_all_to_all_single_unequal_split_cuda_complex
        test_all_to_all_single_unequal_split_full_group_cuda test_all_to_all_single_unequal_split_group_cuda
        test_gather_cuda test_scatter_cuda test_scatter_cuda_complex test_reduce_scatter_tensor_cuda
        test_reduce_scatter_v_cuda test_reduce_sum_cuda test_reduce_sum_cuda_twice
        test_batch_isend_irecv_mixed_backend_err test_batch_isend_irecv_nccl
        test_batch_isend_irecv_no_rank_zero_nccl test_batch_isend_irecv_op_err
        test_batch_isend_irecv_op_list_err test_batch_isend_irecv_ring_exchange_nccl
        test_batch_isend_irecv_self_nccl test_send_recv_nccl test_send_recv_nccl_autograd_profiler
        test_send_recv_nccl_torch_profiler test_nccl_backend_bool_allgather test_nccl_backend_bool_allreduce
        test_nccl_backend_bool_broadcast test_nccl_backend_bool_reduce""", _NCCL_ONLY),
    **_each("""test_monitored_barrier_allreduce_hang test_monitored_barrier_allreduce_hang_wait_all_ranks
        test_ddp_apply_optim_in_backward test_ddp_apply_optim_in_backward_grad_as_bucket_view_false
        test_ddp_apply_optim_in_backward_ignored_params test_ddp_broadcast_buffer
        test_ddp_broadcast_buffer_via_hook test_ddp_broadcast_buffers_deprecation_warning
        test_ddp_bucket_cap_mb_list test_ddp_buffer_hook_allreduce test_ddp_buffer_hook_allreduce_return_future
        test_ddp_build_debug_param_to_name_mapping test_ddp_build_debug_param_to_name_mapping_requires_grad
        test_ddp_comm_hook_logging test_ddp_compile_static_graph test_ddp_control_flow_different_across_ranks
        test_ddp_control_flow_same_across_ranks test_ddp_device test_ddp_device_mesh_initialization
        test_ddp_forward_backward_hook test_ddp_grad_div_uneven_inputs test_ddp_hook_parity_allreduce
        test_ddp_hook_parity_allreduce_process_group test_ddp_hook_parity_post_localSGD
        test_ddp_hook_parity_powerSGD test_ddp_ignore_params_arg test_ddp_inference
        test_ddp_init_sync_buffers_with_forward_sync_buffers_false test_ddp_join_model_equivalence
        test_ddp_join_respects_forward_sync_buffers_false test_ddp_model_diff_num_params_across_ranks
        test_ddp_multiple_nested_unused_params_err_ignore_params test_ddp_multiple_nested_unused_params_error
        test_ddp_namedtuple test_ddp_native_mixed_precision_grad_as_bucket_view_no_set_grad_none
        test_ddp_native_mixed_precision_grad_as_bucket_view_set_grad_to_none
        test_ddp_native_mixed_precision_ignored_params
        test_ddp_native_mixed_precision_no_grad_as_bucket_view_no_set_grad_none
        test_ddp_native_mixed_precision_no_grad_as_bucket_view_set_grad_to_none test_ddp_new_tensor_in_fwd
        test_ddp_new_tensor_in_fwd_static_graph test_ddp_profiling_torch_profiler test_ddp_python_error_logged
        test_ddp_remove_autograd_hooks test_ddp_returns_tensor_with_no_grad test_ddp_shared_grad_acc_unused_params
        test_ddp_sink_noclone test_ddp_static_graph_nested_types test_ddp_sync_module_states
        test_ddp_uneven_input_exception test_ddp_uneven_input_join_disable test_ddp_uneven_inputs
        test_ddp_uneven_inputs_stop_iteration_sync_bn test_ddp_unused_params_rebuild_buckets_exception
        test_ddp_zero_output_features test_detect_ddp_is_actually_static test_stateless_api_with_ddp
        test_static_graph_multi_forward test_sync_bn_logged""", _TWO_GPUS),
    **_each("test_gather_object test_gather_object_subgroup", _WORLD_4),
    **_each("""test_broadcast_object_list test_ddp_sync_bn_training_vs_eval test_barrier_timeout_arg
        test_DistributedDataParallel test_DistributedDataParallel_non_default_stream test_ddp_has_finalized
        test_ddp_hook_pickling_powerSGD test_ddp_model_diff_shape_across_ranks
        test_ddp_profiling_autograd_profiler test_ddp_profiling_execution_trace""", _TORCH_SKIPS),
    **_each("test_coalescing_manager test_coalescing_manager_async",
            "torch runs it for NCCL only (skipped for gloo)"),
    "test_barrier_timeout_global": "needs a file:// rendezvous; torch skips it under its tcp:// one, for gloo too",
    "test_SyncBatchNorm_process_group": "needs torchvision (not installed; skipped for gloo too)",
    **_each("""test_monitored_barrier_gloo test_monitored_barrier_gloo_subgroup
        test_monitored_barrier_gloo_rank_0_timeout test_monitored_barrier_failure_order
        test_monitored_barrier_wait_all_ranks""", _MONITORED),
    **_each("test_all_to_all test_all_to_all_complex test_all_to_all_full_group", _A2A_LIST),
}

# ---------------------------------------------------------------------------------------------
# torch's name-based skips that the runner lifts: {test: the check it overrides}
# ---------------------------------------------------------------------------------------------

_GLOO_ONLY = "require_backend_is_available({'gloo'}): braid runs gloo's CPU path (gloo inside)"
_GET_FUTURE = ("BACKEND not in mpi/nccl/gloo ('get_future is only supported on mpi, nccl and gloo'): "
               "braid's Work has get_future")

LIFTED: dict[str, str] = {
    **_each("""test_all_to_all_single_equal_split test_all_to_all_single_equal_split_complex
        test_all_to_all_single_equal_split_full_group test_all_to_all_single_unequal_split
        test_all_to_all_single_unequal_split_complex test_all_to_all_single_unequal_split_full_group""",
            "BACKEND != 'mpi' ('Only MPI supports CPU all_to_all_single'): gloo and braid both have it"),
    **_each("""test_all_reduce_coalesced_sum test_all_reduce_coalesced_product test_all_reduce_coalesced_min
        test_all_reduce_coalesced_max test_all_reduce_coalesced_full_group_sum
        test_all_reduce_coalesced_full_group_product test_all_reduce_coalesced_full_group_min
        test_all_reduce_coalesced_full_group_max test_grads_same_across_ranks_with_no_sync
        test_scatter_object_list test_all_reduce_coalesced_group_sum test_all_reduce_coalesced_group_product
        test_all_reduce_coalesced_group_min test_all_reduce_coalesced_group_max""", _GLOO_ONLY),
    **_each("""test_all_to_all_single_equal_split_group test_all_to_all_single_unequal_split_group""",
            "BACKEND != 'mpi' ('Only MPI supports CPU all_to_all_single'): gloo and braid both have it"),
    "test_barrier_timeout_group": ("BACKEND != 'gloo' ('Only gloo backend supports timeouts'): "
                                   "braid's barrier runs on gloo with the timeout given"),
    **_each("""test_batch_isend_irecv_gloo test_batch_isend_irecv_gloo_tags""",
            "BACKEND != 'gloo' ('GLOO Batch Send Recv CPU'): braid takes CPU batch_isend_irecv"),
    "test_sparse_all_reduce_sum": ("BACKEND != 'gloo' ('Only Gloo backend supports sparse all reduce'): "
                                   "braid hands sparse tensors to its inner gloo group"),
    "test_barrier_timeout_full_group": ("BACKEND != 'gloo' ('Only gloo backend supports timeouts'): "
                                        "braid's barrier runs on gloo with the timeout given"),
    **_each("""test_get_future test_accumulate_gradients_no_sync test_accumulate_gradients_no_sync_grad_is_view
        test_accumulate_gradients_no_sync_allreduce_hook test_accumulate_gradients_no_sync_allreduce_with_then_hook""",
            _GET_FUTURE),
    # CUDA: the checks that admit NCCL alone (or gloo and NCCL) for CUDA tensors
    **_each("test_all_reduce_sum_cuda test_all_reduce_sum_cuda_async test_all_reduce_sum_cuda_complex",
            "BACKEND not in ('gloo', 'nccl') ('Only Gloo and NCCL backends will have CUDA allReduce tested')"),
    "test_broadcast_cuda": "BACKEND not in ('gloo', 'nccl') ('Only Gloo and Nccl backends support CUDA allReduce')",
    **_each("""test_all_gather_cuda test_all_gather_cuda_complex""",
            "BACKEND != 'nccl' ('Only Nccl supports CUDA all gather')"),
    **_each("test_all_gather_into_cat_tensor_cuda test_all_gather_into_stack_tensor_cuda",
            "BACKEND != 'nccl' ('Only Nccl supports CUDA all_gather_into_tensor')"),
    "test_all_gather_v_cuda": "BACKEND != 'nccl' ('Only Nccl supports all_gather_v')",
    "test_reduce_scatter_tensor_cuda": "BACKEND != 'nccl' ('Only Nccl supports CUDA reduce_scatter_tensor')",
    "test_reduce_scatter_v_cuda": "BACKEND != 'nccl' ('Only Nccl supports reduce_scatter_v')",
    **_each("test_reduce_sum_cuda test_reduce_sum_cuda_twice", "BACKEND != 'nccl' ('Only Nccl supports CUDA reduce')"),
    **_each("test_gather_cuda test_scatter_cuda test_scatter_cuda_complex",
            "BACKEND != 'nccl' ('Only Nccl supports CUDA gather')"),
    **_each("test_all_to_all_cuda test_all_to_all_cuda_complex test_all_to_all_full_group_cuda",
            "BACKEND != 'nccl' ('Only NCCL supports CUDA all_to_all')"),
    **_each("""test_all_to_all_single_equal_split_cuda test_all_to_all_single_equal_split_cuda_complex
        test_all_to_all_single_equal_split_full_group_cuda test_all_to_all_single_unequal_split_cuda
        test_all_to_all_single_unequal_split_cuda_complex test_all_to_all_single_unequal_split_full_group_cuda""",
            "BACKEND != 'nccl' ('Only Nccl supports CUDA all_to_all_single')"),
    "test_send_recv_nccl": "BACKEND != 'nccl' ('NCCL Send Recv Only')",
    **_each("""test_batch_isend_irecv_nccl test_batch_isend_irecv_ring_exchange_nccl test_batch_isend_irecv_self_nccl
        test_batch_isend_irecv_no_rank_zero_nccl""", "BACKEND != 'nccl' ('NCCL Batch Send Recv Only')"),
    **_each("""test_nccl_backend_bool_allreduce test_nccl_backend_bool_allgather test_nccl_backend_bool_broadcast
        test_nccl_backend_bool_reduce""", "require_backend_is_available({'nccl'})"),
}

# tests whose body sets up its model only for BACKEND "mpi"/"gloo"/"nccl" (for any other name it
# never makes `ddp_model`: UnboundLocalError); in braid's ranks the runner sets the test module's
# BACKEND to the reference name after init_process_group("braid"): {test: why}
_DDP_BODY = "its body makes the DDP model only under `if BACKEND == 'gloo'` / `== 'nccl'`"
REFERENCE_BODY: dict[str, str] = _each(
    """test_accumulate_gradients_no_sync test_accumulate_gradients_no_sync_grad_is_view
    test_accumulate_gradients_no_sync_allreduce_hook test_accumulate_gradients_no_sync_allreduce_with_then_hook""",
    _DDP_BODY)

# braid fails, the reference passes, no fix now: {test: why}. The conformance test asserts that
# each still fails (a pass means the entry should go).
KNOWN_FAILURES: dict[str, str] = {}


def selected(device: str = "cpu", full: bool = False) -> list[str]:
    """The tests to run on `device` ("cpu": against gloo; "cuda": against NCCL)."""
    if device == "cuda":
        return list(CUDA)
    if device != "cpu":
        raise ValueError(f"device {device!r}: use 'cpu' or 'cuda'")
    return list(CPU_FULL if full else CPU_CI)


def group_tests() -> list[str]:
    """The subgroup tests, run with GROUP_WORLD ranks on CPU."""
    return list(CPU_GROUP)


def full_requested() -> bool:
    """True when the environment asks for the full list (BRAID_CONFORMANCE_FULL=1)."""
    return os.environ.get(FULL_ENV, "").strip().lower() in ("1", "true", "yes", "on")
