// sm_90a (Hopper) wgmma versions of the M-grouped expert GEMMs; see moe_sm90.cuh.
#include "moe_sm90.cuh"
