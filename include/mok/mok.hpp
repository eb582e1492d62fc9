// Everything public in one include.
#pragma once

#include "mok/api.hpp"
#include "mok/config.hpp"
#include "mok/error.hpp"
#include "mok/fp8.hpp"
#include "mok/host_ep.hpp"
#include "mok/problem.hpp"
#include "mok/tensor.hpp"
#include "mok/version.hpp"
