// A mirror of Python's random.Random (Lib/random.py, Modules/_randommodule.c); see py_random.hpp.
// The twister's code follows CPython's (itself Matsumoto and Nishimura's mt19937ar.c of 2002)
// line for line, with CPython's names, so that the two can be read side by side.
#include "py_random.hpp"

#include <cmath>

namespace kvlife {

namespace {

constexpr uint32_t MATRIX_A = 0x9908b0dfU;    // constant vector a
constexpr uint32_t UPPER_MASK = 0x80000000U;  // most significant w-r bits
constexpr uint32_t LOWER_MASK = 0x7fffffffU;  // least significant r bits

// int.bit_length() of an unsigned value.
int bit_length(PyRandomUWide n) {
    auto hi = static_cast<uint64_t>(n >> 64);
    auto lo = static_cast<uint64_t>(n);
    if (hi != 0) {
        return 128 - __builtin_clzll(hi);
    }
    return lo == 0 ? 0 : 64 - __builtin_clzll(lo);
}

// str(int) of a 128-bit value, for randrange's messages.
std::string decimal(PyRandomWide v) {
    bool negative = v < 0;
    PyRandomUWide u = negative ? PyRandomUWide(0) - static_cast<PyRandomUWide>(v) : static_cast<PyRandomUWide>(v);
    std::string digits;
    do {
        digits.insert(digits.begin(), static_cast<char>('0' + static_cast<int>(u % 10)));
        u /= 10;
    } while (u != 0);
    return negative ? "-" + digits : digits;
}

}  // namespace

// Modules/_randommodule.c genrand_uint32, its "generate N words at one time" branch.
void PyRandom::twist() {
    static const uint32_t mag01[2] = {0x0U, MATRIX_A};  // mag01[x] = x * MATRIX_A for x = 0, 1
    uint32_t* mt = mt_.data();
    uint32_t y;
    int kk;
    for (kk = 0; kk < N - M; kk++) {
        y = (mt[kk] & UPPER_MASK) | (mt[kk + 1] & LOWER_MASK);
        mt[kk] = mt[kk + M] ^ (y >> 1) ^ mag01[y & 0x1U];
    }
    for (; kk < N - 1; kk++) {
        y = (mt[kk] & UPPER_MASK) | (mt[kk + 1] & LOWER_MASK);
        mt[kk] = mt[kk + (M - N)] ^ (y >> 1) ^ mag01[y & 0x1U];
    }
    y = (mt[N - 1] & UPPER_MASK) | (mt[0] & LOWER_MASK);
    mt[N - 1] = mt[M - 1] ^ (y >> 1) ^ mag01[y & 0x1U];
    index_ = 0;
}

// Modules/_randommodule.c init_genrand.
void PyRandom::init_genrand(uint32_t s) {
    uint32_t* mt = mt_.data();
    int mti;
    mt[0] = s;
    for (mti = 1; mti < N; mti++) {
        mt[mti] = (1812433253U * (mt[mti - 1] ^ (mt[mti - 1] >> 30)) + static_cast<uint32_t>(mti));
    }
    index_ = mti;
}

// Modules/_randommodule.c init_by_array.
void PyRandom::init_by_array(const uint32_t* init_key, std::size_t key_length) {
    uint32_t* mt = mt_.data();
    init_genrand(19650218U);
    std::size_t i = 1;
    std::size_t j = 0;
    std::size_t k = (static_cast<std::size_t>(N) > key_length ? static_cast<std::size_t>(N) : key_length);
    for (; k; k--) {
        mt[i] = (mt[i] ^ ((mt[i - 1] ^ (mt[i - 1] >> 30)) * 1664525U)) + init_key[j] +
                static_cast<uint32_t>(j);  // non linear
        i++;
        j++;
        if (i >= static_cast<std::size_t>(N)) {
            mt[0] = mt[N - 1];
            i = 1;
        }
        if (j >= key_length) {
            j = 0;
        }
    }
    for (k = N - 1; k; k--) {
        mt[i] = (mt[i] ^ ((mt[i - 1] ^ (mt[i - 1] >> 30)) * 1566083941U)) - static_cast<uint32_t>(i);  // non linear
        i++;
        if (i >= static_cast<std::size_t>(N)) {
            mt[0] = mt[N - 1];
            i = 1;
        }
    }
    mt[0] = 0x80000000U;  // MSB is 1; assuring non-zero initial array
}

// Modules/_randommodule.c random_seed for a PyLong: n = abs(arg), split into
// keyused = bits == 0 ? 1 : (bits - 1) / 32 + 1 words, least significant first.
void PyRandom::seed(int64_t a) {
    // abs() in unsigned arithmetic: abs(INT64_MIN) is 2**63, which int64_t cannot hold.
    uint64_t n = a < 0 ? uint64_t{0} - static_cast<uint64_t>(a) : static_cast<uint64_t>(a);
    const uint32_t key[2] = {static_cast<uint32_t>(n & 0xffffffffU), static_cast<uint32_t>(n >> 32)};
    init_by_array(key, key[1] != 0 ? 2 : 1);
}

void PyRandom::seed_words(const uint32_t* words, std::size_t count) {
    if (count == 0 || (count > 1 && words[count - 1] == 0)) {
        throw std::invalid_argument("PyRandom.seed_words: give abs(seed)'s words without zero words on top");
    }
    init_by_array(words, count);
}

// Modules/_randommodule.c _random_Random_getrandbits_impl, its loop: words from least to most
// significant, the last one keeping its top k bits.
void PyRandom::fill_bits(int k, uint32_t* words) {
    for (int i = 0; k > 0; i++, k -= 32) {
        uint32_t r = genrand_uint32();
        if (k < 32) {
            r >>= (32 - k);  // Drop least significant bits
        }
        words[i] = r;
    }
}

PyRandomUWide PyRandom::getrandbits_wide(int k) {
    uint32_t words[4] = {0, 0, 0, 0};
    fill_bits(k, words);
    PyRandomUWide r = 0;
    for (int i = 3; i >= 0; i--) {
        r = (r << 32) | words[i];
    }
    return r;
}

uint64_t PyRandom::getrandbits(int k) {
    if (k < 0) {
        throw std::invalid_argument("number of bits must be non-negative");
    }
    if (k > 64) {
        throw std::invalid_argument("PyRandom.getrandbits: k > 64 bits do not fit a uint64_t (getrandbits_words)");
    }
    return static_cast<uint64_t>(getrandbits_wide(k));
}

std::vector<uint32_t> PyRandom::getrandbits_words(int k) {
    if (k < 0) {
        throw std::invalid_argument("number of bits must be non-negative");
    }
    std::vector<uint32_t> words(k == 0 ? 0 : static_cast<std::size_t>((k - 1) / 32 + 1));
    fill_bits(k, words.data());
    return words;
}

// Lib/random.py Random._randbelow_with_getrandbits (n <= 2**64 here: randint's widest range).
PyRandomUWide PyRandom::randbelow_wide(PyRandomUWide n) {
    if (n == 0) {
        throw std::invalid_argument("_randbelow(n) needs n > 0 (CPython's loops forever on 0)");
    }
    int k = bit_length(n);  // don't use (n-1) here because n can be 1
    PyRandomUWide r = getrandbits_wide(k);  // 0 <= r < 2**k
    while (r >= n) {
        r = getrandbits_wide(k);
    }
    return r;
}

// Lib/random.py Random.randrange with stop None.
int64_t PyRandom::randrange(int64_t stop) {
    if (stop > 0) {
        return static_cast<int64_t>(randbelow(static_cast<uint64_t>(stop)));
    }
    throw std::invalid_argument("empty range for randrange()");
}

// Lib/random.py Random.randrange with a stop: the fast path for step 1, then any other step.
int64_t PyRandom::range_draw(PyRandomWide istart, PyRandomWide istop, PyRandomWide istep) {
    PyRandomWide width = istop - istart;
    if (istep == 1) {
        if (width > 0) {
            auto r = static_cast<PyRandomWide>(randbelow_wide(static_cast<PyRandomUWide>(width)));
            return static_cast<int64_t>(istart + r);
        }
        throw EmptyRangeError("empty range in randrange(" + decimal(istart) + ", " + decimal(istop) + ")",
                              "empty range for randrange() (" + decimal(istart) + ", " + decimal(istop) + ", " +
                                  decimal(width) + ")");
    }
    // Python's // floors where C++'s / truncates: they differ only on a negative quotient, and
    // both then give n <= 0, the same empty range.
    PyRandomWide n;
    if (istep > 0) {
        n = (width + istep - 1) / istep;
    } else if (istep < 0) {
        n = (width + istep + 1) / istep;
    } else {
        throw std::invalid_argument("zero step for randrange()");
    }
    if (n <= 0) {
        throw EmptyRangeError(
            "empty range in randrange(" + decimal(istart) + ", " + decimal(istop) + ", " + decimal(istep) + ")",
            "empty range for randrange()");
    }
    auto r = static_cast<PyRandomWide>(randbelow_wide(static_cast<PyRandomUWide>(n)));
    return static_cast<int64_t>(istart + istep * r);
}

// Lib/random.py Random.expovariate; math.log is the C library's log (Modules/mathmodule.c m_log).
double PyRandom::expovariate(double lambd) {
    double x = -std::log(1.0 - random());
    if (lambd == 0.0) {
        throw ZeroDivisionErrorLike("float division by zero");
    }
    return x / lambd;
}

}  // namespace kvlife
