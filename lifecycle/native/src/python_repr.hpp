// Python's repr() of a str, as the f-strings of transfer/index.py and transfer/eviction.py write
// names into their error messages ({name!r}).
#pragma once

#include <string>

namespace kvlife {

// repr(text) for a UTF-8 string: exact for ASCII (the quote Python picks, backslash escapes, \xNN
// for control characters); every non-ASCII character is kept as it is, which is what Python
// does for the printable ones (it would escape a non-printable one such as U+0085 or U+2028).
std::string python_repr(const std::string& text);

}  // namespace kvlife
