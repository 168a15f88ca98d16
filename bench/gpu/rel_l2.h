// The relative L2 distance of a backend's result from a double-precision reference,
// shared by the op-level checks (dream_op_check, dream_lora_check).
#pragma once

#include <cmath>
#include <vector>

inline double rel_l2(const std::vector<float> & a, const std::vector<double> & ref) {
    double num = 0, den = 0;
    for (size_t i = 0; i < a.size(); ++i) {
        num += (a[i] - ref[i]) * (a[i] - ref[i]);
        den += ref[i] * ref[i];
    }
    return std::sqrt(num / den);
}
