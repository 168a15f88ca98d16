// A command-line list split at `sep`, empty items dropped (the bench programs' arguments).
#pragma once

#include <string>
#include <vector>

inline std::vector<std::string> split(const std::string & s, char sep) {
    std::vector<std::string> v;
    for (size_t p = 0; p <= s.size();) {
        size_t q = s.find(sep, p);
        if (q == std::string::npos) q = s.size();
        if (q > p) v.push_back(s.substr(p, q - p));
        p = q + 1;
    }
    return v;
}
