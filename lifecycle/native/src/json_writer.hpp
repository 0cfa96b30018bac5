// The trace's JSON writer: mirrors what lifecycle/traces/trace.py writes for a record
// (structlog's JSONRenderer over orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE)),
// byte for byte: no spaces, strings escaped as orjson escapes them, integers in decimal,
// doubles as orjson formats them (shortest round-trip digits; see write_double), NaN and
// infinities as null. It appends to one growable byte buffer and allocates only when the
// buffer grows.
//
// The writer does not check the structure it is given (a key outside an object, an
// unclosed array): the caller writes well-formed records, the record's "kind" first
// (trace.kind_first).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace kvlife {

// Writes the shortest decimal that reads back as v, placed as orjson places it, at p
// (at least 32 bytes free); returns the end. NaN and infinities write "null".
char* write_double(char* p, double v);

class JsonWriter {
  public:
    // capacity: the buffer's first size in bytes (at least 1); it doubles as needed.
    explicit JsonWriter(std::size_t capacity = 4096);
    ~JsonWriter();
    JsonWriter(const JsonWriter&) = delete;
    JsonWriter& operator=(const JsonWriter&) = delete;

    void begin_object();
    void end_object();
    void begin_array();
    void end_array();
    // An object's key; its value is the next thing written.
    void key(std::string_view utf8);

    void string(std::string_view utf8);
    void int64(std::int64_t v);
    void uint64(std::uint64_t v);
    void boolean(bool v);
    void null();
    void float64(double v);

    // Ends a record: a newline (orjson.OPT_APPEND_NEWLINE); the next value starts a new one.
    void newline();

    const char* data() const { return data_; }
    std::size_t size() const { return size_; }
    std::string_view view() const { return {data_, size_}; }
    // Forgets what was written, keeping the buffer's memory.
    void clear();

  private:
    // Room for n more bytes; returns where they go.
    char* room(std::size_t n) {
        if (capacity_ - size_ < n) grow(n);
        return data_ + size_;
    }
    // Room for a separating comma (written where one is due) and n more bytes.
    char* start(std::size_t n) {
        char* p = room(n + 1);
        if (comma_) *p++ = ',';
        return p;
    }
    void commit(char* end) { size_ = static_cast<std::size_t>(end - data_); }
    void grow(std::size_t need);
    void put_string(std::string_view utf8, bool is_key);

    char* data_;
    std::size_t size_ = 0;
    std::size_t capacity_;
    bool comma_ = false;  // a value was written at this level: the next one needs a comma
};

}  // namespace kvlife
