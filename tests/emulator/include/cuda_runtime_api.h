// stub: cuda_emul.h (force-included) provides what the real cuda_runtime_api.h does
#pragma once
