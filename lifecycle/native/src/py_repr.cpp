// Mirrors CPython's float.__repr__ (Python/pystrtod.c, format_float_short with mode 'r') and
// str.__repr__ (Objects/unicodeobject.c, unicode_repr) for kvlife's error messages.
#include "py_repr.hpp"

#include <charconv>
#include <cmath>
#include <cstdlib>

namespace kvlife {

std::string float_repr(double x) {
    if (std::isnan(x)) {
        return "nan";
    }
    if (std::isinf(x)) {
        return x > 0 ? "inf" : "-inf";
    }
    // Shortest round-trip digits (the same digits as David Gay's dtoa mode 0, which CPython uses),
    // as d.ddde±X; then laid out as CPython does.
    char buf[64];
    auto res = std::to_chars(buf, buf + sizeof buf, x, std::chars_format::scientific);
    std::string_view sci(buf, static_cast<std::size_t>(res.ptr - buf));
    std::string out;
    std::size_t i = 0;
    if (sci[0] == '-') {
        out.push_back('-');
        i = 1;
    }
    std::size_t e = sci.find('e');
    std::string digits;
    for (std::size_t k = i; k < e; ++k) {
        if (sci[k] != '.') {
            digits.push_back(sci[k]);
        }
    }
    int exponent = std::atoi(std::string(sci.substr(e + 1)).c_str());
    int decpt = exponent + 1;  // digits d1 d2 ... with the decimal point after decpt of them
    int ndigits = static_cast<int>(digits.size());
    if (decpt <= -4 || decpt > 16) {
        out.push_back(digits[0]);
        if (ndigits > 1) {
            out.push_back('.');
            out.append(digits, 1, std::string::npos);
        }
        out.push_back('e');
        out.push_back(exponent < 0 ? '-' : '+');
        int mag = exponent < 0 ? -exponent : exponent;
        if (mag < 10) {
            out.push_back('0');
        }
        out += std::to_string(mag);
    } else if (decpt <= 0) {
        out += "0.";
        out.append(static_cast<std::size_t>(-decpt), '0');
        out += digits;
    } else if (decpt >= ndigits) {
        out += digits;
        out.append(static_cast<std::size_t>(decpt - ndigits), '0');
        out += ".0";
    } else {
        out.append(digits, 0, static_cast<std::size_t>(decpt));
        out.push_back('.');
        out.append(digits, static_cast<std::size_t>(decpt), std::string::npos);
    }
    return out;
}

std::string str_repr(std::string_view s) {
    // Single quotes, unless the text holds a single quote and no double one.
    bool single = s.find('\'') != std::string_view::npos;
    bool dbl = s.find('"') != std::string_view::npos;
    char quote = single && !dbl ? '"' : '\'';
    static const char hex[] = "0123456789abcdef";
    std::string out;
    out.reserve(s.size() + 2);
    out.push_back(quote);
    for (char c : s) {
        auto ch = static_cast<unsigned char>(c);
        if (c == quote || c == '\\') {
            out.push_back('\\');
            out.push_back(c);
        } else if (c == '\t') {
            out += "\\t";
        } else if (c == '\n') {
            out += "\\n";
        } else if (c == '\r') {
            out += "\\r";
        } else if (ch < ' ' || ch == 0x7f) {
            out += "\\x";
            out.push_back(hex[ch >> 4]);
            out.push_back(hex[ch & 0xf]);
        } else {
            out.push_back(c);
        }
    }
    out.push_back(quote);
    return out;
}

}  // namespace kvlife
