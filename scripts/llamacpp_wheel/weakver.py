"""Mark an ELF's need of a glibc version weak (VER_FLG_WEAK): ld.so then loads it where
that version is missing (its symbols must come from elsewhere: libisoc23.so)."""
import struct, sys

def patch(path, want=b"GLIBC_2.38"):
    b = bytearray(open(path, "rb").read())
    shoff, = struct.unpack_from("<Q", b, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", b, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", b, shoff + i * shentsize) for i in range(shnum)]
    for s in secs:
        if s[1] == 0x6ffffffe:            # SHT_GNU_verneed
            strtab = secs[s[6]]
            off = s[4]
            while True:
                vn_version, vn_cnt, vn_file, vn_aux, vn_next = struct.unpack_from("<HHIII", b, off)
                a = off + vn_aux
                for _ in range(vn_cnt):
                    h, flags, other, name, nxt = struct.unpack_from("<IHHII", b, a)
                    n0 = strtab[4] + name
                    nm = bytes(b[n0:b.index(0, n0)])
                    if nm == want:
                        struct.pack_into("<H", b, a + 4, flags | 2)
                        print(path, "weak", nm.decode())
                    a += nxt
                if not vn_next:
                    break
                off += vn_next
    open(path, "wb").write(b)

for p in sys.argv[1:]:
    patch(p)
