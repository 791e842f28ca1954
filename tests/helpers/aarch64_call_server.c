/* Calls the kernels of an aarch64 library for tests run on an x86-64 host (tests/helpers/aarch64_kernels.py).
 *
 * Built with aarch64-linux-gnu-gcc and run under qemu-aarch64, it loads the library named on its command line
 * and answers calls on stdin/stdout until stdin closes. A call, every number little-endian:
 *   u32 name length, the name;
 *   u32 region count, then per region u64 size and its bytes (the tensors' storages the call reads or writes, and
 *     the structures it reads);
 *   u32 fix-up count, then per fix-up u32 region, u64 offset, u32 target region, u64 target offset: a pointer
 *     field of a structure in a region, set here to that place in the target region;
 *   u32 argument count, then per argument a kind byte and its value:
 *     'p' u32 region, u64 byte offset (a pointer into a region)   'n' (NULL)
 *     'i' i64   'w' i32   'f' f32
 * The answer: i64 (the function's x0: an int result's low 32 bits, garbage for a void one), then every region's
 * bytes back in order (the kernels write their outputs in place).
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_INT_ARGS 24   /* 8 in x0-x7, the rest in stack slots */
#define MAX_FLOAT_ARGS 8  /* all in s0-s7 */
#define MAX_REGIONS 64

/* Invariant (AAPCS64, the Linux procedure call standard): integer and pointer arguments take x0-x7 in order,
 * then 8-byte stack slots in order (a 32-bit one in the slot's low half), and float arguments take s0-s7
 * independently of them. So a function of any signature with at most 8 float and MAX_INT_ARGS integer
 * arguments, called through this type with its integer arguments in `ints` and its floats in `floats`, finds
 * each argument where it looks for it. */
typedef int64_t (*any_kernel)(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                              float, float, float, float, float, float, float, float,
                              int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                              int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t);

static void read_exactly(void *into, size_t size) {
    if (size && fread(into, 1, size, stdin) != size) {
        exit(0);  /* stdin closed: the tests are done */
    }
}

static void write_exactly(const void *from, size_t size) {
    if (size && fwrite(from, 1, size, stdout) != size) {
        fprintf(stderr, "aarch64_call_server: cannot answer\n");
        exit(1);
    }
}

static void fail(const char *what, const char *name) {
    fprintf(stderr, "aarch64_call_server: %s%s\n", what, name);
    exit(2);
}

static void serve_one_call(void *library) {
    uint32_t name_length, region_count, arg_count;
    char name[128];
    read_exactly(&name_length, 4);
    if (name_length >= sizeof name) fail("function name too long", "");
    read_exactly(name, name_length);
    name[name_length] = 0;
    any_kernel kernel = (any_kernel)dlsym(library, name);
    if (!kernel) fail("no such function: ", name);

    read_exactly(&region_count, 4);
    if (region_count > MAX_REGIONS) fail("too many regions for ", name);
    uint8_t *regions[MAX_REGIONS];
    uint64_t sizes[MAX_REGIONS];
    for (uint32_t r = 0; r < region_count; r++) {
        read_exactly(&sizes[r], 8);
        /* 64-byte aligned as PyTorch's allocations are, rounded up as aligned_alloc needs */
        regions[r] = aligned_alloc(64, (sizes[r] + 63) / 64 * 64 + 64);
        if (!regions[r]) fail("out of memory in ", name);
        read_exactly(regions[r], sizes[r]);
    }

    uint32_t fixup_count;
    read_exactly(&fixup_count, 4);
    for (uint32_t f = 0; f < fixup_count; f++) {
        uint32_t region, target;
        uint64_t offset, target_offset;
        read_exactly(&region, 4);
        read_exactly(&offset, 8);
        read_exactly(&target, 4);
        read_exactly(&target_offset, 8);
        if (region >= region_count || target >= region_count || offset + sizeof(void *) > sizes[region])
            fail("a fix-up outside the regions in ", name);
        uint8_t *pointer = regions[target] + target_offset;
        memcpy(regions[region] + offset, &pointer, sizeof pointer);
    }

    int64_t ints[MAX_INT_ARGS] = {0};
    float floats[MAX_FLOAT_ARGS] = {0};
    int int_count = 0, float_count = 0;
    read_exactly(&arg_count, 4);
    for (uint32_t a = 0; a < arg_count; a++) {
        char kind;
        read_exactly(&kind, 1);
        int64_t value = 0;
        if (kind == 'p') {
            uint32_t region;
            uint64_t offset;
            read_exactly(&region, 4);
            read_exactly(&offset, 8);
            if (region >= region_count) fail("pointer into no region in ", name);
            value = (int64_t)(intptr_t)(regions[region] + offset);
        } else if (kind == 'i') {
            read_exactly(&value, 8);
        } else if (kind == 'w') {
            int32_t narrow;
            read_exactly(&narrow, 4);
            value = narrow;
        } else if (kind == 'f') {
            if (float_count == MAX_FLOAT_ARGS) fail("too many float arguments for ", name);
            read_exactly(&floats[float_count++], 4);
            continue;
        } else if (kind != 'n') {
            fail("unknown argument kind for ", name);
        }
        if (int_count == MAX_INT_ARGS) fail("too many integer arguments for ", name);
        ints[int_count++] = value;
    }

    int64_t result = kernel(ints[0], ints[1], ints[2], ints[3], ints[4], ints[5], ints[6], ints[7],
                            floats[0], floats[1], floats[2], floats[3], floats[4], floats[5], floats[6], floats[7],
                            ints[8], ints[9], ints[10], ints[11], ints[12], ints[13], ints[14], ints[15],
                            ints[16], ints[17], ints[18], ints[19], ints[20], ints[21], ints[22], ints[23]);
    write_exactly(&result, 8);
    for (uint32_t r = 0; r < region_count; r++) {
        write_exactly(regions[r], sizes[r]);
        free(regions[r]);
    }
    fflush(stdout);
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: aarch64_call_server LIBRARY.so\n");
        return 2;
    }
    void *library = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!library) fail("cannot load the library: ", dlerror());
    for (;;) serve_one_call(library);
}
