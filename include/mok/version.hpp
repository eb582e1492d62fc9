#pragma once

namespace mok {
inline constexpr const char* kVersion = "0.1.0";
}
