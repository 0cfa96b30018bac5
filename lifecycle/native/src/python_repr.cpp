// Python's repr() of a str (Objects/unicodeobject.c, unicode_repr), for the error messages that
// transfer/index.py and transfer/eviction.py format with {name!r}.
#include "python_repr.hpp"

namespace kvlife {

std::string python_repr(const std::string& text) {
    // Single quotes, unless the text holds a single quote and no double quote.
    bool has_single = text.find('\'') != std::string::npos;
    bool has_double = text.find('"') != std::string::npos;
    char quote = (has_single && !has_double) ? '"' : '\'';
    static const char hex[] = "0123456789abcdef";
    std::string out;
    out.reserve(text.size() + 2);
    out.push_back(quote);
    for (char c : text) {
        unsigned char u = static_cast<unsigned char>(c);
        if (c == quote || c == '\\') {
            out.push_back('\\');
            out.push_back(c);
        } else if (c == '\t') {
            out += "\\t";
        } else if (c == '\n') {
            out += "\\n";
        } else if (c == '\r') {
            out += "\\r";
        } else if (u < 0x20 || u == 0x7f) {
            out += "\\x";
            out.push_back(hex[u >> 4]);
            out.push_back(hex[u & 0xf]);
        } else {
            out.push_back(c);  // printable ASCII, or a byte of a UTF-8 sequence
        }
    }
    out.push_back(quote);
    return out;
}

}  // namespace kvlife
