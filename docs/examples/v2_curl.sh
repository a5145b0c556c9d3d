#!/usr/bin/env bash
# The Open Inference Protocol with curl, JSON tensors: the model's metadata, then the book's toy
# dot-product request (docs/attend.md) as /v2 inputs. Each answer is printed on a line of its own.
#
#   ATTEND_URL=http://127.0.0.1:8000 bash docs/examples/v2_curl.sh
#
# ATTEND_API_KEY, where the service has ATTEND_API_KEYS, is sent as `Authorization: Bearer <key>`.
# tests/service/test_examples.py runs this file against the real service and checks what it prints.
set -euo pipefail
URL=${ATTEND_URL:-http://127.0.0.1:8000}
auth=()
if [ -n "${ATTEND_API_KEY:-}" ]; then auth=(-H "Authorization: Bearer $ATTEND_API_KEY"); fi

# Inputs and outputs, names, datatypes and shapes (-1: a dynamic axis).
curl -sS --fail-with-body "${auth[@]}" "$URL/v2/models/dot_product"
echo

# Tensors as JSON: shape, datatype and data (flat, row-major; nested lists work too). valid_lens is optional.
curl -sS --fail-with-body "${auth[@]}" "$URL/v2/models/dot_product/infer" \
  -H 'content-type: application/json' -d '{
  "id": "toy-1",
  "inputs": [
    {"name": "queries",    "datatype": "FP32",  "shape": [2, 1, 2], "data": [1, 0, 0, 1]},
    {"name": "keys",       "datatype": "FP32",  "shape": [2, 3, 2], "data": [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]},
    {"name": "values",     "datatype": "FP32",  "shape": [2, 3, 2], "data": [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]},
    {"name": "valid_lens", "datatype": "INT64", "shape": [2],       "data": [2, 3]}
  ]}'
echo
# {"model_name":"dot_product","model_version":"1","id":"toy-1","outputs":[{"name":"outputs","datatype":"FP32",
#  "shape":[2,1,2],"data":[1.0,2.0,2.0,3.0]},{"name":"attention_weights",...,"data":[0.5,0.5,0.0,0.33333334,...]}]}
# On a refusal curl exits 22 and prints the protocol's error body: {"error": "<message>"}.
