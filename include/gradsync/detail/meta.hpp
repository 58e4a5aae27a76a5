// Small metaprogramming helpers shared by the public headers. Users never include detail/.
#pragma once

#include <gradsync/version.hpp>

namespace gradsync::inline v0::detail {

// static_assert(false) inside a template, which g++ 12 rejects before instantiation otherwise.
template <class...>
inline constexpr bool dependent_false = false;

}  // namespace gradsync::inline v0::detail
