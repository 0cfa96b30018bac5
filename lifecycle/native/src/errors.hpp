// Python's built-in exceptions as the native parts raise them: one C++ type per Python type,
// each translated back to that type, with the same message (or key), by bind_errors.cpp.
// (std::invalid_argument is Python's ValueError and std::out_of_range its IndexError, as
// pybind11 translates them.)
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>

namespace kvlife {

// AssertionError(message): a broken invariant or a double release, as the reference raises it.
struct AssertionError : std::logic_error {
    using std::logic_error::logic_error;
};

// KeyError(message), or KeyError(key) as a dict lookup of an int key raises it (str() of it is
// the key itself).
struct KeyError : std::runtime_error {
    explicit KeyError(const std::string& message) : std::runtime_error(message) {}
    explicit KeyError(std::int64_t missing) : std::runtime_error(std::to_string(missing)), key(missing) {}
    std::optional<std::int64_t> key;
};

}  // namespace kvlife
