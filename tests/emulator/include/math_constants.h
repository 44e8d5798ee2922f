// stub of CUDA's math_constants.h (the constants kernels commonly use)
#pragma once
#define CUDART_INF_F __int_as_float(0x7f800000)
#define CUDART_NAN_F __int_as_float(0x7fffffff)
#define CUDART_INF __longlong_as_double(0x7ff0000000000000ULL)
#define CUDART_NAN __longlong_as_double(0xfff8000000000000ULL)
#define CUDART_MAX_NORMAL_F __int_as_float(0x7f7fffff)
#define CUDART_MIN_DENORM_F __int_as_float(0x00000001)
