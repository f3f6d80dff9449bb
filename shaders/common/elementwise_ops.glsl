// Op codes of elementwise.comp (its specialization constant OP). The Python table
// vkformers.engine.kernels.elementwise.OPS holds the same codes; a test checks that
// every OP_* here matches it.
#ifndef VKFORMERS_ELEMENTWISE_OPS_GLSL
#define VKFORMERS_ELEMENTWISE_OPS_GLSL

// unary: out = f(a)
#define OP_NEG 0
#define OP_EXP 1
#define OP_LOG 2
#define OP_SQRT 3
#define OP_RSQRT 4
#define OP_ABS 5
#define OP_TANH 6
#define OP_SIGMOID 7
#define OP_RELU 8
#define OP_GELU 9
#define OP_GELU_TANH 10
#define OP_SILU 11
#define OP_RELU2 12
#define OP_QUICK_GELU 13
#define OP_SIN 14
#define OP_COS 15
#define OP_RECIPROCAL 16
#define OP_SQUARE 17
#define OP_ERF 18
#define OP_SOFTPLUS 19
// unary with scalars s0, s1 (push constants)
#define OP_ADD_SCALAR 20
#define OP_MUL_SCALAR 21
#define OP_POW_SCALAR 22
#define OP_CLAMP 23
#define OP_RSUB_SCALAR 24
// binary: out = f(a, b)
#define OP_ADD 30
#define OP_SUB 31
#define OP_MUL 32
#define OP_DIV 33
#define OP_POW 34
#define OP_MAXIMUM 35
#define OP_MINIMUM 36
// activation backward: out = dx from (x, dy); sigmoid and tanh take their output y instead of x
#define OP_RELU_BACKWARD 40
#define OP_GELU_BACKWARD 41
#define OP_GELU_TANH_BACKWARD 42
#define OP_SILU_BACKWARD 43
#define OP_SIGMOID_BACKWARD 44
#define OP_TANH_BACKWARD 45
#define OP_RELU2_BACKWARD 46
#define OP_QUICK_GELU_BACKWARD 47
#define OP_SOFTPLUS_BACKWARD 48
// compare (the *_cmp variants): out = a <op> b as a byte mask
#define OP_LT 50
#define OP_LE 51
#define OP_GT 52
#define OP_GE 53
#define OP_EQ 54
#define OP_NE 55
// out = mask ? a : b
#define OP_WHERE 60

#define OP_FIRST_SCALAR 20
#define OP_FIRST_BINARY 30

#endif
