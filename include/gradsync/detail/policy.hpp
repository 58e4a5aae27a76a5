// Policy categories and the selection of one policy per category from a front's pack, in
// any order, each defaulted; two of one category, or a type that is no policy, is a clear error.
#pragma once

#include <gradsync/detail/meta.hpp>

#include <concepts>  // for std::convertible_to
#include <string>
#include <tuple>
#include <type_traits>

namespace gradsync::inline v0 {

// A policy type says which category it belongs to with `using policy_category = ...;`.
namespace policy_category {
struct bucketer {};     // groups parameters into buckets (bucket.hpp)
struct memory {};       // where packed bucket buffers live (memory.hpp)
struct packing {};      // whether gradients are copied into bucket buffers (memory.hpp)
struct buffers {};      // what happens to non-parameter state such as batch-norm statistics (buffers.hpp)
struct options {};      // run-time settings (options.hpp)
struct loss_scaler {};  // mixed-precision loss scaling (amp.hpp)
struct compression {};  // the dtype gradients travel in (compression.hpp)
struct lr_rule {};      // the learning rate step() passes to the optimizer (lr.hpp)
struct comm_hook {};    // how a bucket is averaged, in place of the plain allreduce (reduction/comm_hook.hpp)
struct metrics {};      // the training scalars written every step (metrics/step_metrics.hpp)
}  // namespace policy_category

namespace detail {

struct no_policy {};

template <class A, class B>
struct two_policies_of_one_category {
    static_assert(dependent_false<A, B>,
                  "gradsync: two policies of the same category were given to DataParallel or ShardedDataParallel "
                  "(both are named in the instantiation note of two_policies_of_one_category); "
                  "keep one");
    using type = A;
};

template <bool Match, class Found, class P>
struct merge_policy {
    using type = Found;
};
template <class P>
struct merge_policy<true, no_policy, P> {
    using type = P;
};
template <class Found, class P>
struct merge_policy<true, Found, P> : two_policies_of_one_category<Found, P> {};

template <class P>
concept is_policy = requires {
    typename P::policy_category;
};

// What every policy says of itself (Options aside, whose fields are agreed one by one): the text
// every rank must agree on at construction, with each value that changes the result written
// exactly (numbers as detail::exact_text writes them).
template <class P>
concept has_settings = requires(const P& p) {
    { p.settings() } -> std::convertible_to<std::string>;
};

// P's category, or void for a type that is no policy (reported by check_policy).
template <class P>
struct category_of {
    using type = void;
};
template <is_policy P>
struct category_of<P> {
    using type = typename P::policy_category;
};

template <class Category, class Found, class... Ps>
struct find_policy {
    using type = Found;
};
template <class Category, class Found, class P, class... Rest>
struct find_policy<Category, Found, P, Rest...>
    : find_policy<Category,
                  typename merge_policy<std::is_same_v<typename category_of<P>::type, Category>, Found, P>::type,
                  Rest...> {};

template <class P>
constexpr bool check_policy() {
    static_assert(is_policy<P>,
                  "gradsync: a DataParallel or ShardedDataParallel template argument after Model and "
                  "Backend is not a policy (it has no `policy_category` member type); see detail/policy.hpp");
    if constexpr (is_policy<P>)
        static_assert(std::is_same_v<typename P::policy_category, policy_category::options> || has_settings<P>,
                      "gradsync: a policy needs `std::string settings() const`: the text every rank must agree on "
                      "at construction, with every value that changes the result written exactly, so that ranks "
                      "given different settings fail there rather than train apart");
    return true;
}

// The policy of `Category` in Ps..., or Default when there is none.
template <class Category, class Default, class... Ps>
using select_policy =
    std::conditional_t<std::is_same_v<typename find_policy<Category, no_policy, Ps...>::type, no_policy>, Default,
                       typename find_policy<Category, no_policy, Ps...>::type>;

// The value of the policy of type P from a tuple of given policies, or a default-constructed P.
template <class P, class... Ps>
P policy_value(const std::tuple<Ps...>& given) {
    if constexpr ((std::is_same_v<P, Ps> || ...)) {
        return std::get<P>(given);
    } else {
        return P{};
    }
}

}  // namespace detail
}  // namespace gradsync::inline v0
