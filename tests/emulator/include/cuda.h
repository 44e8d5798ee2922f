// stub: cuda_emul.h (force-included) provides what the real cuda.h does
#pragma once
