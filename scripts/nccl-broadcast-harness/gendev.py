"""Cut ncclProtoGrainSize through ncclCollCbdPart out of one tag's include/device.h, unchanged."""
import sys
lines = open(sys.argv[1]).read().split("\n")
a = [i for i, l in enumerate(lines) if "constexpr int ncclProtoGrainSize(int proto)" in l][0]
b = [i for i, l in enumerate(lines) if "void ncclCollCbdPart(" in l][0]
j, depth, seen = b, 0, False
while True:
    depth += lines[j].count("{") - lines[j].count("}")
    seen = seen or "{" in lines[j]
    if seen and depth == 0:
        break
    j += 1
print("\n".join(lines[a:j + 1]))
print(f'static const char* EXTRACTED_DEV = "include/device.h:{a+1}-{j+1}";')
