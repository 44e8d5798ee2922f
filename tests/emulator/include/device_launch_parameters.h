// stub: cuda_emul.h (force-included) provides what the real device_launch_parameters.h does
#pragma once
