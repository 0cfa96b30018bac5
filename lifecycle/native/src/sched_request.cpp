#include "sched_request.hpp"

#include <stdexcept>
#include <string>

namespace kvlife {

Status finished_status(std::string_view reason) {
    if (reason == "stopped") return Status::FINISHED_STOPPED;
    if (reason == "length") return Status::FINISHED_LENGTH_CAPPED;
    if (reason == "aborted") return Status::FINISHED_ABORTED;
    if (reason == "error") return Status::FINISHED_ERROR;
    throw std::invalid_argument("unknown finish reason '" + std::string(reason) + "'");
}

}  // namespace kvlife
