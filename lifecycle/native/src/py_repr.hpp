// What CPython's f-strings print for the values kvlife's error messages carry: a mirror of
// float.__repr__ (Python/pystrtod.c, repr style 'r') and str.__repr__ (Objects/unicodeobject.c,
// unicode_repr), so a native error message reads exactly as the Python reference's.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace kvlife {

// repr(x) / f"{x}" of a float: the shortest digits that round-trip, fixed notation when the
// decimal point falls within [-4, 16) digits, else d.ddde+XX; "inf", "-inf", "nan".
std::string float_repr(double x);

// repr(s) of a str given as UTF-8: exact for ASCII (quote choice, backslash escapes, \xNN for
// control characters). Non-ASCII code points are copied through as they are, which is what
// Python does for printable ones; Python escapes non-printable ones (its Unicode database
// decides which), this does not. kvlife's request ids are ASCII ("req-N").
std::string str_repr(std::string_view s);

}  // namespace kvlife
