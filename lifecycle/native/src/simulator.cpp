// The non-template part of the simulator loop (simulator.hpp; lifecycle/drivers/simulator.py).
#include "simulator.hpp"

namespace kvlife {

void ArrivalBuffer::clear() {
    ids.clear();
    arrival_ms.clear();
    input_length.clear();
    output_length.clear();
    hash_start.clear();
    hashes.clear();
    next = 0;
}

}  // namespace kvlife
