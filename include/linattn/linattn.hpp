#pragma once
/// \file linattn.hpp
/// Umbrella header: everything linattn offers except the components with their own CMake
/// target and dependency: the thread pool (linattn/thread_pool.hpp, linattn::threads), MPI
/// (linattn/mpi.hpp and mpi_gradients.hpp, linattn::mpi) and PyTorch (linattn/torch.hpp,
/// linattn::torch). Each header below also compiles on its own.

#include <linattn/attention.hpp>
#include <linattn/backward_workspace.hpp>
#include <linattn/batch_state.hpp>
#include <linattn/errors.hpp>
#include <linattn/executor.hpp>
#include <linattn/feature_maps.hpp>
#include <linattn/gradients.hpp>
#include <linattn/head_config.hpp>
#include <linattn/multihead.hpp>
#include <linattn/multihead_gradients.hpp>
#include <linattn/multihead_saved_forward.hpp>
#include <linattn/normalization.hpp>
#include <linattn/options.hpp>
#include <linattn/random_features.hpp>
#include <linattn/reference.hpp>
#include <linattn/rule_gradients.hpp>
#include <linattn/rule_saved_forward.hpp>
#include <linattn/rule_state.hpp>
#include <linattn/saved_forward.hpp>
#include <linattn/sequence_layout.hpp>
#include <linattn/serialize.hpp>
#include <linattn/state.hpp>
#include <linattn/tensor_view.hpp>
#include <linattn/types.hpp>
#include <linattn/write_rules.hpp>
