/* The sizes of the structs shared with ctypes (appliance/native/abi.py checks them at load, so a Python side
 * and a library built from different headers never exchange misread structs). */
#include "kq_internal.h"

int64_t kq_struct_size(int which) {
    switch (which) {
    case 0: return (int64_t)sizeof(kq_linear);
    case 1: return (int64_t)sizeof(kq_layer);
    case 2: return (int64_t)sizeof(kq_model);
    case 3: return (int64_t)sizeof(kq_moe);
    default: return -1;
    }
}
