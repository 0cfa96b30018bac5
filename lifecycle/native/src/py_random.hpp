// A mirror of Python's random.Random (CPython 3.11-3.13: Lib/random.py over the Mersenne Twister
// of Modules/_randommodule.c), drawing bit for bit the numbers the simulator draws from
// random.Random(config.sim.seed) (lifecycle/drivers/simulator.py: random(), uniform()) and
// random.Random(config.sim.chaos) (lifecycle/drivers/chaos.py: random(), uniform()).
// The integer draws built on getrandbits (_randbelow, randrange, randint, choice, shuffle) and
// expovariate are the other methods kvlife calls with a seed from its config
// (lifecycle/workloads/synthetic.py); they are mirrored too.
//
// Seeds: an int64 (every seed a config can hold: lifecycle/config.py bounds sim.seed to int64),
// or, for any larger Python int, the 32-bit words of its absolute value (seed_words).
// Not mirrored: seeding from None/float/str/bytes (Random seeds those from urandom, hash() or
// SHA-512), gauss/gammavariate and the other distributions, setstate.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace kvlife {

// 128-bit integers for randrange's widths: the width of two int64 bounds (and randint's b + 1)
// need not fit 64 bits, and Python computes them exactly. GCC and Clang on 64-bit targets.
__extension__ typedef __int128 PyRandomWide;
__extension__ typedef unsigned __int128 PyRandomUWide;

class PyRandom {
  public:
    // Python's exceptions, nested so that no other building block's names can clash with them.
    // Python's IndexError (choice of an empty sequence).
    struct IndexErrorLike : std::runtime_error {
        using std::runtime_error::runtime_error;
    };
    // Python's ZeroDivisionError (expovariate(0.0)).
    struct ZeroDivisionErrorLike : std::runtime_error {
        using std::runtime_error::runtime_error;
    };
    // randrange's ValueError for an empty range. CPython 3.12 reworded it (Lib/random.py,
    // Random.randrange): what() is 3.12+'s text, python311 3.11's, for the binding to pick.
    struct EmptyRangeError : std::invalid_argument {
        EmptyRangeError(const std::string& message, std::string message311)
            : std::invalid_argument(message), python311(std::move(message311)) {}
        std::string python311;
    };

    // Modules/_randommodule.c: N and M, the twister's period parameters.
    static constexpr int N = 624;
    static constexpr int M = 397;

    // random.Random(seed) for an int seed.
    explicit PyRandom(int64_t seed) { this->seed(seed); }

    // Random.seed(a) for an int a (Lib/random.py hands an int to _random.Random.seed unchanged):
    // Modules/_randommodule.c random_seed: init_by_array over the 32-bit words of abs(a),
    // least significant first, as many as abs(a) has significant bits (one for 0).
    void seed(int64_t a);
    // The same for an int of any size: `words` are abs(a)'s words, least significant first,
    // exactly max(1, ceil(bits / 32)) of them (no zero word on top, except the one word of 0).
    void seed_words(const uint32_t* words, std::size_t count);

    // _random.Random.random: (a * 2**26 + b) / 2**53 from two words' top 27 and 26 bits.
    double random() {
        uint32_t a = genrand_uint32() >> 5;
        uint32_t b = genrand_uint32() >> 6;
        return (a * 67108864.0 + b) * (1.0 / 9007199254740992.0);
    }

    // Random.uniform (Lib/random.py): a + (b - a) * random().
    double uniform(double a, double b) { return a + (b - a) * random(); }

    // _random.Random.getrandbits for 0 <= k <= 64 (std::invalid_argument: ValueError for k < 0).
    uint64_t getrandbits(int k);
    // getrandbits(k) for any k >= 0: its ceil(k / 32) words, least significant first.
    std::vector<uint32_t> getrandbits_words(int k);

    // Random._randbelow (Lib/random.py _randbelow_with_getrandbits): getrandbits(n.bit_length())
    // until below n. Python's loops forever for n == 0; this throws std::invalid_argument.
    uint64_t randbelow(uint64_t n) { return static_cast<uint64_t>(randbelow_wide(n)); }

    // Random.randrange(stop) and randrange(start, stop, step): Python's checks and messages.
    int64_t randrange(int64_t stop);
    int64_t randrange(int64_t start, int64_t stop, int64_t step = 1) { return range_draw(start, stop, step); }
    // Random.randint: randrange(a, b + 1), with b + 1 computed exactly.
    int64_t randint(int64_t a, int64_t b) { return range_draw(a, static_cast<PyRandomWide>(b) + 1, 1); }

    // Random.choice: seq[_randbelow(len(seq))]; any Seq with size() and operator[].
    template <class Seq>
    decltype(auto) choice(const Seq& seq) {
        std::size_t n = seq.size();
        if (n == 0) {
            throw IndexErrorLike("Cannot choose from an empty sequence");
        }
        return seq[static_cast<std::size_t>(randbelow(n))];
    }

    // Random.shuffle: for i in reversed(range(1, len(x))): swap x[i] and x[_randbelow(i + 1)].
    template <class Seq>
    void shuffle(Seq& x) {
        for (std::size_t i = x.size(); i > 1;) {
            --i;
            std::size_t j = static_cast<std::size_t>(randbelow(i + 1));
            using std::swap;
            swap(x[i], x[j]);
        }
    }

    // Random.expovariate (Lib/random.py): -log(1.0 - random()) / lambd, with the draw made
    // before the division fails (ZeroDivisionErrorLike) for lambd == 0, as in Python.
    // (3.12 gave lambd a default of 1.0; 3.11 has none, so neither has this.)
    double expovariate(double lambd);

    // _random.Random.getstate's tuple: the 624 words and the index of the next one.
    const std::array<uint32_t, N>& state() const { return mt_; }
    int index() const { return index_; }

  private:
    // Modules/_randommodule.c genrand_uint32: the next tempered word (twisting every N words).
    uint32_t genrand_uint32() {
        if (index_ >= N) {
            twist();
        }
        uint32_t y = mt_[index_++];
        y ^= (y >> 11);
        y ^= (y << 7) & 0x9d2c5680U;
        y ^= (y << 15) & 0xefc60000U;
        y ^= (y >> 18);
        return y;
    }

    void twist();
    void init_genrand(uint32_t s);
    void init_by_array(const uint32_t* init_key, std::size_t key_length);
    // getrandbits(k)'s words into `words`: ceil(k / 32) of them.
    void fill_bits(int k, uint32_t* words);
    PyRandomUWide getrandbits_wide(int k);
    PyRandomUWide randbelow_wide(PyRandomUWide n);
    int64_t range_draw(PyRandomWide istart, PyRandomWide istop, PyRandomWide istep);

    std::array<uint32_t, N> mt_{};
    int index_ = N + 1;
};

}  // namespace kvlife
