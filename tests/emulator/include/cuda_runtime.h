// stub: cuda_emul.h (force-included) provides what the real cuda_runtime.h does
#pragma once
