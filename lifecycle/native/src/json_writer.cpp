// The trace's JSON writer: mirrors lifecycle/traces/trace.py's rendering (orjson.dumps through
// structlog's JSONRenderer), byte for byte.
#include "json_writer.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>

namespace kvlife {

namespace {

// Which bytes orjson escapes in a string: '"', '\\' and the control characters below 0x20.
// Everything else is copied as it is: DEL, U+2028/U+2029 and all other non-ASCII UTF-8.
struct EscapeTable {
    bool needs[256] = {};
    constexpr EscapeTable() {
        for (int c = 0; c < 0x20; ++c) needs[c] = true;
        needs[static_cast<unsigned char>('"')] = true;
        needs[static_cast<unsigned char>('\\')] = true;
    }
};
constexpr EscapeTable kEscape{};

char* write_escape(char* p, unsigned char c) {
    *p++ = '\\';
    switch (c) {
        case '"': *p++ = '"'; return p;
        case '\\': *p++ = '\\'; return p;
        case '\b': *p++ = 'b'; return p;
        case '\t': *p++ = 't'; return p;
        case '\n': *p++ = 'n'; return p;
        case '\f': *p++ = 'f'; return p;
        case '\r': *p++ = 'r'; return p;
        default: break;
    }
    // Every other control character: \u00XX, hex digits in lower case (\u000b, \u001f).
    static const char kHex[] = "0123456789abcdef";
    p[0] = 'u';
    p[1] = '0';
    p[2] = '0';
    p[3] = kHex[c >> 4];
    p[4] = kHex[c & 0xf];
    return p + 5;
}

// Each writes n bytes at p and returns their end: the length written is the length advanced.
char* put(char* p, const char* s, std::size_t n) {
    std::memcpy(p, s, n);
    return p + n;
}

char* write_zeros(char* p, int n) {
    std::memset(p, '0', static_cast<std::size_t>(n));
    return p + n;
}

}  // namespace

// orjson (3.11+) formats a double with zmij (https://github.com/dtolnay/zmij, src/lib.rs
// `write`): the shortest digits d1 d2 ... dn that read back as v, with v = d1.d2...dn x 10^e.
// For -5 <= e <= 15 it writes them in fixed notation, always with a point and at least one
// digit after it (1e15 -> 1000000000000000.0, 1.5e-5 -> 0.000015); otherwise in exponent
// notation, the point only where there is more than one digit, the exponent signed and
// without leading zeros (1e16 -> 1e+16, 1e-6 -> 1e-6, 1.5e-300 -> 1.5e-300). Zero is 0.0 or
// -0.0. std::to_chars in scientific format without a precision gives the same shortest,
// correctly rounded digits; only their placement is done here.
char* write_double(char* p, double v) {
    if (!std::isfinite(v)) {
        std::memcpy(p, "null", 4);
        return p + 4;
    }
    if (std::signbit(v)) {
        *p++ = '-';
        v = -v;
    }
    if (v == 0.0) {
        std::memcpy(p, "0.0", 3);
        return p + 3;
    }
    // "D.DDDDe+XX": at most 17 digits, a point, 'e', a sign and 3 exponent digits.
    char sci[32];
    const char* end = std::to_chars(sci, sci + sizeof sci, v, std::chars_format::scientific).ptr;
    char digits[20];
    int n = 0;
    const char* q = sci;
    digits[n++] = *q++;
    if (*q == '.') {
        for (++q; *q != 'e'; ++q) digits[n++] = *q;
    }
    ++q;  // 'e'
    const bool negative_exponent = *q++ == '-';
    int e = 0;
    for (; q < end; ++q) e = e * 10 + (*q - '0');
    if (negative_exponent) e = -e;

    if (e >= -5 && e <= 15) {
        if (n - 1 <= e) {  // an integer: 1234e7 -> 12340000000.0
            p = write_zeros(put(p, digits, n), e + 1 - n);
            return put(p, ".0", 2);
        }
        if (e >= 0) {  // 1.234e1 -> 12.34
            p = put(put(p, digits, e + 1), ".", 1);
            return put(p, digits + e + 1, n - e - 1);
        }
        // 1.234e-3 -> 0.001234
        p = write_zeros(put(p, "0.", 2), -e - 1);
        return put(p, digits, n);
    }
    *p++ = digits[0];
    if (n > 1) p = put(put(p, ".", 1), digits + 1, n - 1);
    *p++ = 'e';
    if (e < 0) {
        *p++ = '-';
        e = -e;
    } else {
        *p++ = '+';
    }
    return std::to_chars(p, p + 3, e).ptr;
}

JsonWriter::JsonWriter(std::size_t capacity) : capacity_(capacity) {
    data_ = static_cast<char*>(std::malloc(capacity_));
    if (data_ == nullptr) throw std::bad_alloc();
}

JsonWriter::~JsonWriter() { std::free(data_); }

void JsonWriter::grow(std::size_t need) {
    const std::size_t capacity = std::max(capacity_ * 2, size_ + need);
    char* data = static_cast<char*>(std::realloc(data_, capacity));
    if (data == nullptr) throw std::bad_alloc();
    data_ = data;
    capacity_ = capacity;
}

void JsonWriter::clear() {
    size_ = 0;
    comma_ = false;
}

void JsonWriter::begin_object() {
    char* p = start(1);
    *p++ = '{';
    commit(p);
    comma_ = false;
}

void JsonWriter::end_object() {
    char* p = room(1);
    *p++ = '}';
    commit(p);
    comma_ = true;
}

void JsonWriter::begin_array() {
    char* p = start(1);
    *p++ = '[';
    commit(p);
    comma_ = false;
}

void JsonWriter::end_array() {
    char* p = room(1);
    *p++ = ']';
    commit(p);
    comma_ = true;
}

void JsonWriter::key(std::string_view utf8) { put_string(utf8, true); }

void JsonWriter::string(std::string_view utf8) { put_string(utf8, false); }

void JsonWriter::put_string(std::string_view utf8, bool is_key) {
    // Worst case: every byte a \u00XX escape, two quotes and a colon.
    char* p = start(utf8.size() * 6 + 3);
    *p++ = '"';
    const unsigned char* in = reinterpret_cast<const unsigned char*>(utf8.data());
    const unsigned char* const end = in + utf8.size();
    for (;;) {
        const unsigned char* run = in;
        while (in != end && !kEscape.needs[*in]) ++in;
        p = put(p, reinterpret_cast<const char*>(run), static_cast<std::size_t>(in - run));
        if (in == end) break;
        p = write_escape(p, *in++);
    }
    *p++ = '"';
    if (is_key) *p++ = ':';
    commit(p);
    comma_ = !is_key;
}

void JsonWriter::int64(std::int64_t v) {
    char* p = start(20);
    commit(std::to_chars(p, p + 20, v).ptr);
    comma_ = true;
}

void JsonWriter::uint64(std::uint64_t v) {
    char* p = start(20);
    commit(std::to_chars(p, p + 20, v).ptr);
    comma_ = true;
}

void JsonWriter::boolean(bool v) {
    char* p = start(5);
    if (v) {
        std::memcpy(p, "true", 4);
        p += 4;
    } else {
        std::memcpy(p, "false", 5);
        p += 5;
    }
    commit(p);
    comma_ = true;
}

void JsonWriter::null() {
    char* p = start(4);
    std::memcpy(p, "null", 4);
    commit(p + 4);
    comma_ = true;
}

void JsonWriter::float64(double v) {
    char* p = start(32);
    commit(write_double(p, v));
    comma_ = true;
}

void JsonWriter::newline() {
    char* p = room(1);
    *p++ = '\n';
    commit(p);
    comma_ = false;
}

}  // namespace kvlife
