// stub: cuda_emul.h (force-included) provides what the real cuda_bf16.h does
#pragma once
