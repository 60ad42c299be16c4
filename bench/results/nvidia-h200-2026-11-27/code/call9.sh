source scratch/dev/prefix.sh
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 100 python3 -m pytest -m gpu -q -x tests/test_kt_gpu_mapped_experts.py -k "int4 or 4_bit" 2>&1 | tail -3
timeout 80 python3 -m bench.expert_streaming --method AMXINT4 --tokens 2048 --held 32 --layers 4 2>&1 | grep summary
